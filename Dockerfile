# One image for every gpulens process (exporter, agent, coordinator, gateway, operator, analysis,
# the trainer hook's init container). Build: `podman build -t gpulens:0.1.0 .` (or docker build);
# on machines without a registry, image/build.sh makes the base image locally first.
ARG BASE=docker.io/library/debian:bookworm-slim

# ---- the Python environment: pinned runtime closure, then the package, all --no-deps --------
FROM ${BASE} AS venv
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/gpulens
COPY image/requirements.txt /tmp/requirements.txt
# HTA (traceinsight) declares jupyterlab and pydot (~1 GB); image/lock.py lists what it imports.
RUN /opt/gpulens/bin/pip install --no-cache-dir --no-deps --only-binary=:all: -r /tmp/requirements.txt
# The design card's layout: pyproject.toml maps each top-level folder to its gpulens.* name.
COPY pyproject.toml setup.py README.md /src/
COPY gpulens /src/gpulens
COPY exporter /src/exporter
COPY capture /src/capture
COPY alertrules /src/alertrules
COPY dashboards /src/dashboards
COPY hooks /src/hooks
RUN /opt/gpulens/bin/pip install --no-cache-dir --no-deps /src \
 && /opt/gpulens/bin/pip uninstall -y -q pip setuptools \
 && find /opt/gpulens/lib -type d -name tests -prune -exec rm -rf {} + \
 && /opt/gpulens/bin/python -m compileall -q /opt/gpulens/lib

# ---- Debian's generic kernel headers, for nodes that ship none (COS, Bottlerocket, Talos) ----
# Only what bcc includes: include/ and arch/<arch>/include/, common and generated parts merged
# into one tree (bcc's BCC_KERNEL_SOURCE layout). The exporter uses it only when the host's
# /lib/modules/<release> has no headers (exporter/kheaders.py).
FROM ${BASE} AS headers
RUN set -eu; apt-get update; cd /tmp; \
    arch=$(dpkg --print-architecture); case "$arch" in amd64) karch=x86;; arm64) karch=arm64;; *) karch=$arch;; esac; \
    pkg=$(apt-cache depends "linux-headers-$arch" | sed -n 's/^ *Depends: \(linux-headers-.*\)$/\1/p' | head -n1); \
    common=$(apt-cache depends "$pkg" | sed -n 's/^ *Depends: \(linux-headers-.*-common\)$/\1/p' | head -n1); \
    apt-get download "$pkg" "$common"; \
    for d in ./*.deb; do dpkg-deb -x "$d" /x; done; \
    out=/usr/lib/gpulens/kernel-headers; mkdir -p "$out/arch/$karch"; \
    cp -a /x/usr/src/"$common"/include "$out/"; \
    cp -a /x/usr/src/"$common"/arch/"$karch"/include "$out/arch/$karch/"; \
    cp -a /x/usr/src/"$pkg"/include/. "$out/include/"; \
    cp -a /x/usr/src/"$pkg"/arch/"$karch"/include/. "$out/arch/$karch/include/"; \
    echo "$pkg" > "$out/PACKAGE"; test -f "$out/include/linux/kconfig.h"; \
    rm -rf /var/lib/apt/lists/* /x ./*.deb

# ---- the runtime image ------------------------------------------------------------------------
FROM ${BASE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="gpulens" \
      org.opencontainers.image.description="GPU observability for PyTorch training on Kubernetes: exporter, node agent, capture coordinator, gateway, operator, analysis" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.url="https://gpulens.dev" \
      org.opencontainers.image.source="https://gpulens.dev/source" \
      org.opencontainers.image.base.name="debian:bookworm-slim"
# Debian's Python 3.11 and bcc (python3-bpfcc: libbcc with its clang/LLVM, the exporter's compiler);
# busybox-static: the static shell the webhook's init container runs inside a trainer's own image
# (capture/operator/arming.py, image_env_container), which need not have one.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-bpfcc busybox-static \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log \
 && useradd --system --uid 65532 --user-group --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin gpulens
COPY --from=headers /usr/lib/gpulens/kernel-headers /usr/lib/gpulens/kernel-headers
COPY --from=venv /opt/gpulens /opt/gpulens
# Debian's bcc is pure Python over libbcc: link only that package into the venv (as scripts/setup.sh).
RUN ln -s /usr/lib/python3/dist-packages/bcc \
      "$(/opt/gpulens/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/bcc" \
 && /opt/gpulens/bin/python -c 'import bcc, gpulens, hta.trace_analysis'
ENV PATH=/opt/gpulens/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GPULENS_KERNEL_HEADERS=/usr/lib/gpulens/kernel-headers
# Non-root by default, with a passwd entry (kopf asks getpass.getuser()); the chart raises the
# node DaemonSet's containers to root with only the capabilities they need.
USER 65532:65532
ENTRYPOINT ["gpulens"]
CMD ["--help"]
