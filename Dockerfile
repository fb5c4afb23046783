# trtforge on NVIDIA's Triton Inference Server image (GPU deployment).
#
#   docker build -t trtforge:latest .
#   docker run --rm --gpus all -v /path/to/hf-checkpoint:/models/ckpt:ro -v trtforge-engines:/engines \
#       trtforge:latest build-engine /models/ckpt --output /engines/model --backend tensorrt --dtype bfloat16 \
#         --triton-repo /engines/repo
#   docker run --rm --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 -v trtforge-engines:/engines \
#       trtforge:latest trtforge serve /engines/repo
#
# See docs/tensorrt.md. The TensorRT Python wheel is pinned to the TensorRT release of the base
# image: a plan only loads in the TensorRT version that built it, so build and serve with this image.
ARG TRITON_VERSION=25.01
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3

# TensorRT shipped in tritonserver:25.01 (its release notes list the version of each image).
ARG TENSORRT_VERSION=10.8.0.43
# Triton 2.54 is the server in tritonserver:25.01.
ARG TRITON_CLIENT_VERSION=2.54.0

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1 \
    TRTFORGE_TRITONSERVER=/opt/tritonserver/bin/tritonserver \
    TRTFORGE_TRITON_BACKENDS=/opt/tritonserver/backends

WORKDIR /opt/trtforge
COPY pyproject.toml README.md ./
COPY config ./config
COPY plugins ./plugins
COPY models ./models
COPY builder ./builder
COPY serving ./serving
COPY model_repo ./model_repo
COPY frontend ./frontend
COPY dynamo_backend ./dynamo_backend
COPY bench ./bench
COPY cli ./cli

# torch from PyPI is the CUDA build on Linux x86-64; the [tensorrt] extra brings tensorrt + triton.
# DL3013 flags the unpinned "." : that is this project itself, from the build context.
# hadolint ignore=DL3013
RUN python3 -m pip install "tensorrt==${TENSORRT_VERSION}" ".[onnx,tensorrt]" "tritonclient[all]==${TRITON_CLIENT_VERSION}" \
    && python3 -c "import tensorrt, torch, trtforge.builder; print('tensorrt', tensorrt.__version__, 'torch', torch.__version__)"

WORKDIR /workspace
EXPOSE 8000 8001 8002
CMD ["trtforge", "--help"]
