# GPU run 4: the final tree: tests/gpu, generate's graphs across generates, bench (decode b1, MLP, padded, generate), training bench b1 and b32, generate breakdown
set -o pipefail
export PYTHONUNBUFFERED=1
echo "== tests/gpu"; PYTHONPATH=. timeout 240 python3 -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | grep -E "passed|failed|FAILED|Error|^E |fuzz on" | tail -25
echo "== generate: graphs over three generates"; PYTHONPATH=. timeout 40 python3 - <<'PY' 2>&1 | grep -v Warn | tail -4
import torch, autograph
from autograph.cli.bench_generate import build_model
model = build_model(); fast = autograph.graphed(model)
ids = torch.randint(3, 32000, (1, 16), device="cuda")
kw = dict(attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=32, do_sample=False, cache_implementation="static", disable_compile=True)
for i in range(3):
    a = fast.generate(ids, **kw); b = model.generate(ids, **kw)
    s = autograph.stats(fast); print(i, "equal", torch.equal(a, b), "captures", s["captures"], "graphs", s["graphs"], "replays", s["replays"], "calls", s["calls"])
PY
echo "== bench"; PYTHONPATH=. timeout 190 python3 -m autograph bench --batch 1 --rounds 9 --no-train --json $OUT/bench.json 2>&1 | grep -v "^\[\|^W1201\|Warn\|warn" | tail -32
echo "== bench_train"; PYTHONPATH=. timeout 170 python3 -m autograph.cli.bench_train --batch 1 32 --rounds 5 --steps 100 --json $OUT/train.json 2>&1 | grep -v "Warn\|warn\|^\[" | tail -16
echo "== generate breakdown"; PYTHONPATH=. timeout 80 python3 tools/generate_breakdown.py --new 64 2>&1 | grep -v Warn | tail -8
