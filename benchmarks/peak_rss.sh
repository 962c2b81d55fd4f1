#!/bin/bash
# Peak RSS of a W1-like run (128 prompt tokens, 128 new, greedy, 2 threads): tokenmill on the
# default Q4_1 GGUF as stored and with --dtype bfloat16, against llama.cpp (llama-cpp-python
# from `benchmarks/compare.py install`) on the same file. KV budgets: tokenmill
# KV_MEMORY (default 16MiB) with max_model_len 512, llama.cpp n_ctx 512. Not part of CI.
#   benchmarks/peak_rss.sh [RUNS] [KV_MEMORY]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
KV=${2:-16MiB}
PEERS=${PEERS:-$HOME/.cache/tokenmill/peers}
MODEL=$(.venv/bin/python -c "from tokenmill.config import default_model_path; print(default_model_path())")
TMP=$(mktemp -d)
cat > "$TMP/tm.py" <<PY
import sys
from tokenmill import LLM, SamplingParams
kw = dict(num_threads=2, kv_cache_memory="$KV", max_model_len=512)
if len(sys.argv) > 1: kw["dtype"] = sys.argv[1]
llm = LLM(**kw)
out = llm.generate([list(range(1000, 1128))], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 128
PY
cat > "$TMP/lc.py" <<PY
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, n_threads_batch=2, verbose=False)
for n, _ in enumerate(llm.generate(list(range(1000, 1128)), temp=0.0), 1):
    if n == 128: break
PY
for _ in $(seq "$RUNS"); do
  /usr/bin/time -f "tokenmill Q4_1 as stored: %M KiB peak RSS, %e s" .venv/bin/python "$TMP/tm.py" 2>&1 | grep "peak RSS"
  /usr/bin/time -f "tokenmill --dtype bfloat16: %M KiB peak RSS, %e s" .venv/bin/python "$TMP/tm.py" bfloat16 2>&1 | grep "peak RSS"
  /usr/bin/time -f "llama.cpp Q4_1: %M KiB peak RSS, %e s" "$PEERS/llamacpp/bin/python" "$TMP/lc.py" "$MODEL" 2>&1 | grep "peak RSS"
done
rm -rf "$TMP"
