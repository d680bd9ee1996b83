"""Benchmark (not a test): SFT throughput of 05_sft.py's objectives, side by side in one run.

Same model, same machine, same optimizer (AdamW over every parameter): for each configuration, a few
optimizer steps on the first batches of the seeded example stream, timed after one warm-up step.
  prompt   : one instruction row per target item (the LC-Rec / GTI format), --prompt-batch rows a step
  sequence : windows of <= max_history + 1 items, every item after the first a target, --batch rows a step
each with --softmax full (the 49k-wide head on every supervised position) and level (the level's codes
only), in float32 and, on CPUs with native bf16 (or CUDA), under bf16 autocast.
Prints seconds per step, supervised target items per second and the model FLOP/s (bench/flops.py)
as a share of a 2048^3 matmul's in the same dtype, timed in the same run; last line
`sequence vs prompt: X.Xx target items/s` (both at 05's default softmax and dtype).

CPU:  python bench/sft_throughput.py --model out/ml-100k/models/centroid+gti
GPU:  python bench/sft_throughput.py --model out/ml-100k/models/centroid+gti --device cuda --batch 64 --prompt-batch 128
"""
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Parser, load_sid_model, load_step, pad_id, pick_autocast, pick_device, pos_int  # noqa: E402
from flops import body_params, gflops, matmul_flops  # noqa: E402

sft = load_step("05_sft")                     # reuse 05's examples, rows, collate and loss (not a numbered step)


def parse_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--model", default="out/ml-100k/models/centroid+gti", help="a model folder with SID tokens (03/04)")
    p.add_argument("--out-dir", default="", help="artifacts folder (empty: two levels above --model)")
    p.add_argument("--batch", type=pos_int, default=8, help="sequence windows per step (05's default --batch-size)")
    p.add_argument("--prompt-batch", type=pos_int, default=16,
                   help="instruction rows per step for the prompt objective (the LC-Rec / GTI instruction format)")
    p.add_argument("--steps", type=pos_int, default=3, help="timed steps per configuration (after one warm-up step)")
    p.add_argument("--max-history", type=pos_int, default=20, help="history items (05's default)")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda", "mps"], help="auto = cuda, else cpu")
    return p.parse_args(argv)


def main():
    args = parse_args()
    device = pick_device(args.device)
    out_dir = args.out_dir or os.path.dirname(os.path.dirname(os.path.abspath(args.model)))
    model, tok, vocab, data, _, item_tok, _ = load_sid_model(args.model, out_dir, "cpu")
    model.to(device).train()
    level_tok = [torch.tensor(t) for t in vocab["token_ids"]]
    state0 = {k: v.clone() for k, v in model.state_dict().items()}
    pad = pad_id(tok)
    train = data["train"]
    dtypes = ["float32"] + (["bfloat16"] if "bf16" in pick_autocast("auto", device)[1] else [])
    default_dtype = dtypes[-1]
    print(f"device {device}  threads {torch.get_num_threads()}  dtypes {dtypes}  model {args.model}")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    body, d = body_params(model), model.get_output_embeddings().weight.shape[1]
    peak = {dtype: matmul_flops(device, pick_autocast(dtype, device)[0]) for dtype in dtypes}
    print(f"body parameters {body / 1e6:.1f}M; 2048^3 matmul: "
          + ", ".join(f"{k} {gflops(v)}" for k, v in peak.items()))
    res, fraction = {}, {}
    for objective in ("prompt", "sequence"):
        rec, _ = sft.build_examples(train, len(item_tok), objective, args.max_history, 0.0, 0)
        rows = sft.RowBuilder(tok, objective, item_tok, data["texts"], train, args.max_history)
        size = args.prompt_batch if objective == "prompt" else args.batch
        batches = [sft.collate([rows.row(rec[i]) for i in sft.stream_batch(len(rec), s * size, size, 0)], pad)
                   for s in range(args.steps + 1)]
        for softmax in ("full", "level"):
            for dtype in dtypes:
                model.load_state_dict(state0)                                  # same start for every config
                loss_model = sft.SIDLoss(model, softmax, level_tok).to(device)
                V, C = loss_model.col_of.shape[0], loss_model.cols.shape[0]     # head columns
                opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
                ctx = pick_autocast(dtype, device)[0]
                items, t, flop = 0, 0.0, 0.0
                for s, batch in enumerate(batches):
                    ids, mask, pos, labels = (x.to(device) for x in batch)
                    sync()
                    t0 = time.perf_counter()
                    with ctx:
                        loss, hits = loss_model(ids, mask, pos, labels)
                    (loss / len(hits)).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    sync()
                    if s > 0:                                                   # step 0 warms up
                        t += time.perf_counter() - t0
                        col = loss_model.col_of[labels[labels != sft.IGNORE]]       # head rows
                        sid_rows = int((col >= 0).sum()) if softmax != "full" else 0
                        flop += 6 * (body * ids.numel() + d * (C * sid_rows + V * (len(col) - sid_rows)))
                        items += len(hits) // (len(vocab["level_names"]) + (objective == "prompt"))
                res[objective, softmax, dtype] = items / t
                fraction[objective, softmax, dtype] = flop / t / peak[dtype]
                print(f"{objective:8s} softmax {softmax:5s} {dtype:8s}  {t / args.steps:6.2f} s/step  "
                      f"{items // args.steps:4d} target items/step  {items / t:7.1f} target items/s  "
                      f"{gflops(flop / t)} = {flop / t / peak[dtype]:.0%} of the matmul's")
    print(f"sequence vs prompt at softmax full, {default_dtype}: "
          f"{res['sequence', 'full', default_dtype] / res['prompt', 'full', default_dtype]:.1f}x; "
          f"05's default (sequence, level, {default_dtype}) vs instruction rows (prompt, full, float32): "
          f"{res['sequence', 'level', default_dtype] / res['prompt', 'full', 'float32']:.1f}x")
    print(f"05's default (sequence, level, {default_dtype}) reaches "
          f"{fraction['sequence', 'level', default_dtype]:.0%} of the {default_dtype} matmul's FLOP/s")
    print(f"sequence vs prompt: {res['sequence', 'level', default_dtype] / res['prompt', 'level', default_dtype]:.1f}x "
          "target items/s")


if __name__ == "__main__":
    sys.exit(main())
