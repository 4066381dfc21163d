# Hourglass container image: the `hourglass` CLI as entrypoint (node, metaserver, demo, send ...).
#
#   docker build -t hourglass:0.1.0 .                                   # on python:3.11-slim
#   docker build --build-arg BASE_IMAGE=hourglass-base:bookworm -t hourglass:dev .
#   docker run --rm --network host hourglass:dev demo
#
# BASE_IMAGE is any Debian-like image with python3 (>= 3.11) and its venv module: the public
# python:3.11-slim by default; scripts/image.sh makes one with debootstrap where nothing can be
# pulled. Both stages use the same base so the virtualenv's interpreter path matches.
# When .cache/wheelhouse holds wheels (scripts/image.sh fills it) the install is offline.
ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- build: a virtualenv in /opt/hourglass
FROM ${BASE_IMAGE} AS build
LABEL org.hourglass.stage=build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/hourglass
WORKDIR /src
# dependencies first (own layer: source edits do not reinstall them). The wildcard makes the
# wheelhouse optional: pyproject.toml always matches, so COPY never fails on a missing folder.
COPY pyproject.toml README.md /src/
COPY pyproject.toml .cache/wheelhous[e] /wheelhouse/
RUN python3 -c "import tomllib; d = tomllib.load(open('/src/pyproject.toml', 'rb')); \
print('\n'.join(d['project']['dependencies'] + ['setuptools>=68', 'wheel']))" > /tmp/requirements.txt \
 && if ls /wheelhouse/*.whl >/dev/null 2>&1; then set -- --no-index --find-links /wheelhouse; fi \
 && /opt/hourglass/bin/pip install -q "$@" -r /tmp/requirements.txt
COPY cluster /src/cluster
COPY node /src/node
COPY metaserver /src/metaserver
RUN /opt/hourglass/bin/pip install -q --no-deps --no-build-isolation /src \
 && /opt/hourglass/bin/pip uninstall -q -y setuptools wheel \
 && /opt/hourglass/bin/hourglass --help >/dev/null

# ---------------------------------------------------------------- runtime: venv only, non-root
FROM ${BASE_IMAGE} AS runtime
ARG UID=10001
# `hourglass demo` and `hourglass dev up` start a local etcd (/usr/bin/etcd). Debian's etcd-server is
# installed unless the base has it already; --build-arg ETCD_PACKAGE= leaves it out (Kubernetes
# installs never run etcd from this image).
ARG ETCD_PACKAGE=etcd-server
RUN if [ -n "${ETCD_PACKAGE}" ] && [ ! -x /usr/bin/etcd ]; then \
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${ETCD_PACKAGE}" >/dev/null && rm -rf /var/lib/apt/lists/*; \
    fi
RUN (command -v useradd >/dev/null && useradd --uid "${UID}" --user-group --home-dir /home/hourglass \
        --create-home --shell /usr/sbin/nologin hourglass) \
 && mkdir -p /var/lib/hourglass && chown "${UID}:${UID}" /var/lib/hourglass
COPY --from=build /opt/hourglass /opt/hourglass
ENV PATH=/opt/hourglass/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOURGLASS_DATA_DIR=/var/lib/hourglass
USER ${UID}:${UID}
WORKDIR /home/hourglass
# node gRPC 7000, node metrics 9100, meta server gRPC 7100 (all set by flags or HOURGLASS_* variables)
EXPOSE 7000 7100 9100
ENTRYPOINT ["/opt/hourglass/bin/hourglass"]
CMD ["--help"]
