#!/bin/sh
# The wheels benchmarks/gpu.py needs on the GPU machine beyond its image (KINDS.md lists what the
# image holds: torch, transformers, peft, safetensors, tokenizers, absl-py, click, joblib, regex,
# six, tqdm, numpy): the final evaluation's ROUGE-L (rouge-score, which imports nltk; nltk needs
# defusedxml), and the clients' partition (data/partition.py: flwr-datasets, which imports datasets;
# datasets needs dill and multiprocess, the rest of its needs are in the image; without them every
# engine run failed there, 2026-11-28: "No module named 'flwr_datasets'"). All pure Python (about
# 2.7 MB). Run from the repository root on a machine with PyPI:
#     sh benchmarks/gpu_wheels.sh        # -> .whl/ (about 2 MB; add /.whl/ to .git/info/exclude)
# then on the GPU machine (benchmarks/README.md):
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
set -eu
PY=${PYTHON:-python3}
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl nltk==3.10.4 defusedxml==0.7.1 flwr-datasets==0.6.1 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
"$PY" -m pip wheel --no-deps -w .whl rouge-score==0.1.2   # an sdist only: built here, pure Python
ls -l .whl
