"""Issue 33, Amendment 2's CPU trial: the long task's warm start at a reduced size, its loss curve (means of 25
steps) and its held-out loss by token role (each held-out text alone, no padding). The same texts as the demo's
warm start of seed 0 (`demo.tasks.build_task_checkpoint`), without its deterministic mode (a CPU run is anyway).

    python research/gpu/study33_cpu_trial.py HIDDEN LAYERS HEADS STEPS LR [MAX_OPERAND]
    python research/gpu/study33_cpu_trial.py 128 4 4 300 3e-3     # Amendment 2's run (8.8 s a step on 2 busy cores)
"""
import os, random, sys, time, json
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
import toy  # examples/toy.py
TASK = dict(min_terms=4, max_terms=5, max_operand=int(sys.argv[6]) if len(sys.argv) > 6 else 99_999_999)
hidden, layers, heads, steps, lr = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
torch.manual_seed(0); torch.set_num_threads(2)
tok = toy.build_scratchpad_tokenizer()
model = toy.build_model(tok, hidden_size=hidden, layers=layers, heads=heads, seed=0, max_positions=240)
rng = random.Random(1)
rows = toy.sum_problems(steps * 64, seed=1, **TASK)
styles = rng.choices(range(3), (0.2, 0.2, 0.6), k=len(rows))
texts = [r["prompt"] + toy.column_solution(r["terms"], s) + tok.eos_token for r, s in zip(rows, styles)]
losses = []
t = time.perf_counter()
toy.supervised_warm_start(model, tok, texts, batch_size=64, lr=lr, losses=losses)
secs = time.perf_counter() - t
# held-out loss by role (seed 2 prompts), full style and sums style
model.eval()
held = toy.sum_problems(256, seed=2, **TASK)
hs = random.Random(2).choices(range(3), (0.2, 0.2, 0.6), k=256)
acc = {}
for r, s in zip(held, hs):
    text = r["prompt"] + toy.column_solution(r["terms"], s) + tok.eos_token
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    nll = -logp.gather(1, ids[0, 1:, None])[:, 0]
    roles = ["prompt"] * (len(r["prompt"]) - 1) + toy.column_token_roles(r["terms"], s)
    for ro, v in zip(roles, nll.tolist()):
        a = acc.setdefault(ro, [0.0, 0]); a[0] += v; a[1] += 1
byrole = {k: round(v[0] / v[1], 3) for k, v in acc.items()}
curve = [round(sum(losses[i:i + 25]) / len(losses[i:i + 25]), 3) for i in range(0, len(losses), 25)]
print(json.dumps(dict(max_operand=TASK["max_operand"], hidden=hidden, layers=layers, lr=lr, steps=steps, s_per_step=round(secs / steps, 3),
                      curve25=curve, by_role=byrole)), flush=True)
