"""Input-grounded prompts: a task (repeat, correct, rewrite, summarize, annotate code) over
a passage given in the prompt, so much of the answer copies from the input. These are
the prompts speculative decoding is measured on (`tokenmill bench offline` W5/W6,
`tokenmill bench serve --dataset-name grounded`); the passages were written for
tokenmill, with a few deliberate slips for the correction tasks.
"""

from __future__ import annotations

import random

PROSE = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
    "great lens, and wrote the wether in a leather logbook. Ships passing the rocky point saw the beam sweep "
    "across the water every twelve seconds, and on foggy nights he sounded the horn untill morning.",
    "Our team will move to the new office on the third floor next Monday. Please pack your desks by Friday "
    "afternoon and label every box with your name and department. The movers arrive at eight o'clock, and the "
    "network will be down untill noon while the technicians connect the new switches.",
    "To make the bread, mix the flour, salt and yeast in a large bowl. Add the warm water slowly and knead the "
    "dough for ten minutes until it is smooth. Leave it to rise in a warm place for one hour, then shape the "
    "loaf, bake it at two hundred degrees for thirty minutes and let it cool on a rack.",
    "The city council approved the new bicycle lanes on Tuesday after a long debate. The lanes will run along "
    "the river from the old bridge to the train station, and construction is expected to begin in the spring. "
    "Residents who live on the route will recieve a letter explaining the changes to parking.",
    "Dear Maria, thank you for sending the report so quickly. I have read the first two chapters and the "
    "figures look correct. Could you add a short summary at the beginning and check the dates in the third "
    "table? I would like to share it with the board on Thursday. Best regards, Thomas.",
    "The museum's new exhibition shows tools used by farmers two hundred years ago. Visitors can see ploughs, "
    "scythes and butter churns, and children can try grinding wheat with a small stone mill. The exhibition "
    "is open every day except Monday, and entry is free for students and teachers.",
]

CODE = [
    "def scale(values, factor):\n    result = []\n    for value in values:\n        result.append(value * factor)\n"
    "    return result\n\n\ndef average(values):\n    if not values:\n        return 0.0\n"
    "    return sum(values) / len(values)\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n\n\ndef most_common(counts, n):\n"
    "    return sorted(counts.items(), key=lambda item: item[1], reverse=True)[:n]\n",
]

PROSE_TASKS = [
    "Repeat the following text exactly, word for word:",
    "Correct the spelling mistakes in the following text and return the whole corrected text:",
    "Rewrite the following text in a more formal tone:",
    "Summarize the following text in two sentences:",
]

CODE_TASKS = [
    "Add type hints to the following Python code and return the whole code:",
    "Add a docstring to each function in the following Python code and return the whole code:",
]

# Every (task, passage) pair, in a fixed order: prose tasks over prose, code tasks over code.
PAIRS = [(task, passage) for task in PROSE_TASKS for passage in PROSE] + \
        [(task, code) for task in CODE_TASKS for code in CODE]


def grounded_messages(count: int, rng: random.Random) -> list[list[dict[str, str]]]:
    """`count` chat conversations of one user message each. The task/passage pairs are
    shuffled by `rng` and taken in turn (every pair once before any repeats); each
    message starts with a document number drawn from `rng`, so that repetitions do not
    share prompts beyond the chat template's preamble."""
    order = list(range(len(PAIRS)))
    rng.shuffle(order)
    conversations = []
    for i in range(count):
        task, passage = PAIRS[order[i % len(order)]]
        text = f"Document {rng.randrange(10_000, 100_000)}. {task}\n\n{passage}"
        conversations.append([{"role": "user", "content": text}])
    return conversations
