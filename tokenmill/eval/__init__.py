"""Model evaluation through the engine itself: `tokenmill eval perplexity`."""
