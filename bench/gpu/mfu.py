"""Tokens/s and model FLOPs utilisation of a ``ctl up --json`` train run (bench/gpu_check.sh).

FLOPs per token: 6 N (forward and backward through the N weights a token meets) plus 12 L H T for attention's
scores and values (PaLM's appendix B accounting); peak: the GPU's dense bf16 rate (``--peak-tflops``, by
default the H100/H200 SXM datasheet's 989)."""

import argparse
import json
import sys

import yaml

ap = argparse.ArgumentParser()
ap.add_argument("status_json")
ap.add_argument("job_file")
ap.add_argument("--peak-tflops", type=float, default=989.0)
ap.add_argument("--dtype", default="bf16")
ns = ap.parse_args()
status = json.load(open(ns.status_json))
model = yaml.safe_load(open(ns.job_file))["model"]
L, H, T, V = model["layers"], model["hidden"], model["seq_len"], model["vocab"]
F = model.get("ffn_hidden") or 4 * H
n_weights = L * (4 * H * H + 2 * H * F) + V * H
flops_per_token = 6 * n_weights + 12 * L * H * T
if status["state"] != "SUCCEEDED":
    sys.exit(f"train job {status['state']}: {status['reason']}")
final = status["result"]["final"]
tps = final["tokens_per_s"]
mfu = tps * flops_per_token / (ns.peak_tflops * 1e12)
losses = [p["loss"] for p in status["losses"]]
print(f"train {ns.dtype}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, step {final['step_time_s'] * 1e3:.1f} ms, "
      f"peak memory {final.get('peak_mem_mb', 0):.0f} MiB")
print(f"train {ns.dtype}: {tps:,.0f} tokens/s, {n_weights / 1e6:.1f} M weights, {flops_per_token / 1e9:.2f} GFLOP/token, "
      f"MFU {100 * mfu:.1f} % of {ns.peak_tflops:g} TFLOP/s")
if not losses[-1] < losses[0]:
    sys.exit("the loss did not fall")
