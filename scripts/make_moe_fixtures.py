#!/usr/bin/env python3
"""Tiny random MoE fixtures with transformers as the reference: qwen2_moe, mixtral, olmoe, granitemoe, plus the
routing reference for every MoE fixture (qwen3_moe included).

Needs torch + transformers 5.23 (~3 GB; CI never runs this, it reads the committed outputs). We ran it on
the lent GPU machine's CPU (PyTorch + transformers installed there, no network):

    python3 scripts/make_moe_fixtures.py --out tests/fixtures/moe-tiny \
        [--llama-cpp DIR]   # a llama.cpp tree (convert_hf_to_gguf.py, conversion/, gguf-py/) -> <arch>.gguf

The tokenizer is not trained here: every model reuses the tokenizer files of the qwen3_moe fixture
(`tests/fixtures/moe-tiny/qwen3_moe`, copied from ../shared/fixtures/moe-tiny, vocab 512) and the same
prompt ids, so the fixtures differ only in architecture.

Per architecture it writes
  <arch>/                 HF dir: config.json, model.safetensors (bf16), generation_config.json, tokenizer files
  <arch>.gguf             (with --llama-cpp) llama.cpp's converter output, f32
  <arch>.reference.json   input ids, last-position logits of a float32 forward (rounded 1e-5), per-position
                          argmax, 16 greedy ids through generate() (KV cache), near-tie margins, seed
  <arch>.routing.json     per MoE layer: expert ids [seq, k] and weights [seq, k] exactly as transformers'
                          router module returned them for the prompt (forward hooks on the `*TopKRouter`
                          modules), and the router logits [seq, E] from `output_router_logits=True`

Seeds are re-drawn until no router top-k boundary or greedy top-2 logit gap is a near tie, so harmless float
rounding differences between engines cannot flip an expert or a token.
"""
import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig

SEED = 4321
N_GEN = 16
MIN_ROUTER_MARGIN = 1e-4
MIN_LOGIT_GAP = 1e-3

COMMON = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    initializer_range=0.02, use_cache=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
ARCHS = {
    # shared expert with sigmoid gate, qkv bias, no top-k renormalisation
    "qwen2_moe": dict(model_type="qwen2_moe", cls="Qwen2MoeForCausalLM", cfg=dict(
        **COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
        shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        qkv_bias=True, use_sliding_window=False)),
    # qwen3_moe with dense layers: mlp_only_layers and decoder_sparse_step (llama.cpp cannot convert it: HF only)
    "qwen3_moe_dense": dict(model_type="qwen3_moe", cls="Qwen3MoeForCausalLM", gguf=False, cfg=dict(
        **COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3])),
    # router softmax -> top-k -> always renormalised; per-expert w1/w2/w3 checkpoint names
    "mixtral": dict(model_type="mixtral", cls="MixtralForCausalLM", cfg=dict(
        **COMMON, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=None)),
    # q/k RMSNorm over the whole projection (not per head), no renormalisation
    "olmoe": dict(model_type="olmoe", cls="OlmoeForCausalLM", cfg=dict(
        **COMMON, num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False,
        clip_qkv=None)),
    # Granite MoE: embedding/residual/attention/logit multipliers, softmax over the top-k logits,
    # fused `input_linear` [E, 2I, H] experts (the new-architecture proof of issue 23)
    "granitemoe": dict(model_type="granitemoe", cls="GraniteMoeForCausalLM", cfg=dict(
        **COMMON, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
        embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)),
}
PRE_TOKENIZER = "qwen2"


def randomize_(model, seed):
    """O(1)-scale activations: norms near 1 (not exactly), embeddings N(0,1), linear weights N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def build(arch, seed, eos):
    spec = ARCHS[arch]
    cfg = AutoConfig.for_model(spec["model_type"], **spec["cfg"])
    cfg.architectures = [spec["cls"]]
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = None, eos, 0
    torch.manual_seed(seed)
    model = getattr(transformers, spec["cls"])(cfg).eval()
    randomize_(model, seed)
    with torch.no_grad():  # the float32 reference runs on exactly the stored bf16 values
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model, cfg


def routing(model, ids):
    """Expert ids/weights per MoE layer as transformers' router modules return them, plus router logits."""
    captured = {}
    hooks = []
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("TopKRouter"):
            layer = int(name.split("layers.")[1].split(".")[0])

            def hook(_m, _inp, out, layer=layer):
                logits, scores, indices = out
                captured[layer] = (logits.detach().float(), scores.detach().float(), indices.detach())

            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=True)
    for h in hooks:
        h.remove()
    layers = sorted(captured)
    router_logits = [rl.float() for rl in out.router_logits]
    assert len(router_logits) == len(layers), (len(router_logits), layers)
    result = []
    for layer, rl in zip(layers, router_logits):
        logits, scores, indices = captured[layer]
        assert torch.equal(logits, rl.reshape(logits.shape)), "hooked logits differ from output_router_logits"
        result.append({
            "layer": layer,
            "expert_ids": indices.tolist(),
            "expert_weights": [[round(float(w), 7) for w in row] for row in scores],
            "router_logits": [[round(float(v), 6) for v in row] for row in logits],
        })
    k = model.config.num_experts_per_tok
    margin = min(float((t[:, k - 1] - t[:, k]).min())
                 for t in (torch.topk(torch.softmax(captured[layer][0], -1), k + 1, -1).values for layer in layers))
    return result, margin


def reference(model, ids):
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits[0].float()
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_GEN, min_new_tokens=N_GEN,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        gen_ids = gen[0, len(ids):].tolist()
        seq, gaps = list(ids), []
        for _ in range(N_GEN):  # no-cache greedy must agree with generate()
            last = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
            top2 = torch.topk(last, 2).values
            gaps.append(float(top2[0] - top2[1]))
            seq.append(int(last.argmax()))
    assert seq[len(ids):] == gen_ids, (seq[len(ids):], gen_ids)
    top2 = torch.topk(logits, 2, -1).values
    _, margin = routing(model, ids + gen_ids)
    return {
        "input_ids": ids,
        "last_logits": [round(float(v), 5) for v in logits[-1]],
        "argmax_per_position": logits.argmax(-1).tolist(),
        "greedy_ids": gen_ids,
        "min_top2_logit_gap_prompt": round(float((top2[:, 0] - top2[:, 1]).min()), 6),
        "min_top2_logit_gap_greedy": round(min(gaps), 6),
        "min_router_topk_prob_margin": margin,
    }


def convert_gguf(llama_cpp, model_dir, out_file):
    shim = out_file.parent / "_convert_shim.py"
    shim.write_text(
        "import sys, runpy\n"
        "root, pre = sys.argv[1], sys.argv[2]\n"
        "sys.argv = [root + '/convert_hf_to_gguf.py'] + sys.argv[3:]\n"
        "sys.path[:0] = [root, root + '/gguf-py']\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    r = subprocess.run([sys.executable, str(shim), str(llama_cpp), PRE_TOKENIZER, str(model_dir), "--outfile",
                        str(out_file), "--outtype", "f32"], capture_output=True, text=True)
    shim.unlink()
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"GGUF conversion of {model_dir} failed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/moe-tiny"))
    ap.add_argument("--archs", default="qwen2_moe,mixtral,olmoe,qwen3_moe_dense")
    ap.add_argument("--llama-cpp", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(4)
    tok_dir = args.out / "qwen3_moe"
    base_ref = json.loads((args.out / "qwen3_moe.reference.json").read_text())
    ids = base_ref["input_ids"]
    eos = json.loads((tok_dir / "config.json").read_text())["eos_token_id"]

    # routing reference for the given qwen3_moe fixture
    q3 = transformers.Qwen3MoeForCausalLM.from_pretrained(tok_dir, dtype=torch.float32).eval()
    q3_routing, _ = routing(q3, ids)
    (args.out / "qwen3_moe.routing.json").write_text(json.dumps({"input_ids": ids, "layers": q3_routing}) + "\n")

    for arch in [a for a in args.archs.split(",") if a]:
        for seed in range(SEED, SEED + 50):
            model, cfg = build(arch, seed, eos)
            ref = reference(model, ids)
            ok = (ref["min_router_topk_prob_margin"] >= MIN_ROUTER_MARGIN
                  and min(ref["min_top2_logit_gap_prompt"], ref["min_top2_logit_gap_greedy"]) >= MIN_LOGIT_GAP)
            print(f"[{arch}] seed {seed}: margins {ref['min_router_topk_prob_margin']:.2e} "
                  f"{ref['min_top2_logit_gap_prompt']:.2e} {ref['min_top2_logit_gap_greedy']:.2e} ok={ok}", flush=True)
            if ok:
                break
        else:
            raise SystemExit(f"{arch}: no seed without near ties")
        ref.update(seed=seed, arch=arch, architecture=ARCHS[arch]["cls"], transformers=transformers.__version__,
                   torch=torch.__version__)
        mdir = args.out / arch
        if mdir.exists():
            shutil.rmtree(mdir)
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = 0
        model.to(torch.bfloat16).save_pretrained(mdir, safe_serialization=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(tok_dir / f, mdir / f)
        # the saved checkpoint must reproduce the reference
        re = getattr(transformers, ARCHS[arch]["cls"]).from_pretrained(mdir, dtype=torch.float32).eval()
        with torch.no_grad():
            l2 = re(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        ref["reload_max_abs_diff_last_logits"] = float((l2 - torch.tensor(ref["last_logits"])).abs().max())
        (args.out / f"{arch}.reference.json").write_text(json.dumps(ref) + "\n")
        layers, _ = routing(re, ids)
        (args.out / f"{arch}.routing.json").write_text(json.dumps({"input_ids": ids, "layers": layers}) + "\n")
        if args.llama_cpp and ARCHS[arch].get("gguf", True):
            convert_gguf(args.llama_cpp, mdir, args.out / f"{arch}.gguf")
        print(f"[{arch}] seed {seed} greedy {ref['greedy_ids']} reload diff {ref['reload_max_abs_diff_last_logits']:.1e}")


if __name__ == "__main__":
    main()
