#!/usr/bin/env bash
# A real, single-node Kubernetes for `make test-k8s`: a control plane (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler) and one kubelet node on containerd + runc with the
# CNI bridge plugin, the project's image built by buildah and imported into the node.
#
#   cluster.sh install   Debian packages and the Kubernetes source package      (~1-2 min, once)
#   cluster.sh build     kube-apiserver, -controller-manager, -scheduler, kubelet (7-10 min cold on
#                        2 cores; seconds with the Go build cache kept)
#   cluster.sh image     the project's image from its Dockerfile on a local Debian base
#   cluster.sh up        certificates, etcd, containerd, control plane, node    (~30 s)
#   cluster.sh down      stop every process by its PID, remove mounts, netns and the bridge
#   cluster.sh env       print the environment the tests need (KUBECONFIG, ...)
#
# Where the parts come from, and why:
# - Kubernetes 1.20.2 is built from Debian bookworm's *source* package `kubernetes`, which ships
#   its Go dependencies in vendor/: this machine kind reaches the Debian, PyPI and npm registries
#   only (no Go module proxy, no container registry), so no newer release can be built or pulled.
# - etcd 3.4, containerd 1.6, runc, the CNI plugins, buildah and debootstrap are Debian packages;
#   helm and kubectl are the ones `make tools` installs into .tools/bin.
# - No registry is reachable, so the Dockerfile's Python base image cannot be pulled: a Debian
#   bookworm root filesystem made by debootstrap (python3 is 3.11 there, as in the official
#   python:3.11-slim-bookworm image) is committed as a local image and passed through the
#   Dockerfile's PYTHON_IMAGE build argument. Production builds use the official base.
#
# Everything lives under $RECEIPTS_K8S_CACHE (default /var/cache/receipts-k8s), outside the
# clone, so a second run on the same machine reuses the build. Needs root (network namespaces,
# a bridge, containerd). Only addresses on the bridge this script creates receive traffic.
set -euo pipefail

CACHE=${RECEIPTS_K8S_CACHE:-/var/cache/receipts-k8s}
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KVER=1.20.2
SRC=$CACHE/src/kubernetes-$KVER          # source tree; its _output/ keeps the Go build cache
KBIN=$CACHE/bin                          # the four built binaries, copied out of _output
STATE=$CACHE/state                       # one cluster's state: wiped by `up`, removed by `down`
PKI=$STATE/pki
RUN=$STATE/run
LOGS=$STATE/logs
TOOLS=$REPO/.tools/bin

API_PORT=${RECEIPTS_K8S_API_PORT:-36443}
ETCD_PORT=${RECEIPTS_K8S_ETCD_PORT:-23791}
ETCD_PEER=${RECEIPTS_K8S_ETCD_PEER_PORT:-23801}
KUBELET_PORT=${RECEIPTS_K8S_KUBELET_PORT:-30250}
POD_CIDR=${RECEIPTS_K8S_POD_CIDR:-10.244.0.0/24}
PREFIX_LEN=${POD_CIDR#*/}
NET_BASE=${POD_CIDR%.*}                   # 10.244.0
NODE_IP=$NET_BASE.1                       # the bridge's address: the node, and the host services
BRIDGE=rcptk8s0
HOSTNET=rcptk8s-host                      # netns for the test's services on the bridge (.250)
HOSTNET_IP=$NET_BASE.250
IMAGE=localhost/receipts:k8s-test
PAUSE_IMAGE=localhost/pause:3.4.1

log() { printf 'k8s: %s\n' "$*" >&2; }
need_root() { [ "$(id -u)" -eq 0 ] || { log "needs root (network namespaces, a bridge, containerd)"; exit 1; }; }

# ------------------------------------------------------------------------------------------
install() {
    need_root
    local pkgs="etcd-server etcd-client containerd runc containernetworking-plugins buildah
                debootstrap golang-go golang-github-modern-go-reflect2-dev dpkg-dev jq openssl
                iproute2 gcc libc6-dev"
    local missing=""
    for p in $pkgs; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"; done
    if [ -n "$missing" ] || [ ! -d "$SRC" ]; then
        # `apt-get source` needs a deb-src entry: the machine's own first Debian entry, retyped
        if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
            awk 'BEGIN{RS="";ORS="\n\n"} NR==1' /etc/apt/sources.list.d/debian.sources \
                | sed -e 's/^Types: deb$/Types: deb-src/' -e 's/^Suites: .*/Suites: bookworm/' \
                > /etc/apt/sources.list.d/receipts-k8s-src.sources
        fi
        apt-get update -qq
    fi
    if [ -n "$missing" ]; then
        log "installing$missing"
        # shellcheck disable=SC2086
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
    fi
    # containerd's own service (if the package started one) is not the one used here
    systemctl disable --now containerd >/dev/null 2>&1 || true
    [ -x "$TOOLS/helm" ] && [ -x "$TOOLS/kubectl" ] || bash "$REPO/scripts/install-tools.sh"
    if [ ! -d "$SRC" ]; then
        log "fetching Debian's kubernetes source package"
        local dl=$CACHE/src/dl
        rm -rf "$dl" && mkdir -p "$dl"
        ( cd "$dl" && apt-get source --download-only -qq kubernetes >/dev/null \
            && dpkg-source -x --no-check kubernetes_*.dsc tree >/dev/null )
        # The vendored modern-go/reflect2 1.0.1 makes kube-apiserver crash under Go >= 1.18
        # ("fatal error: fault" in UnsafeMapType.UnsafeIterate on the first custom resource);
        # Debian's 1.0.2 of the same library fixes it.
        local r=$dl/tree/vendor/github.com/modern-go/reflect2
        rm -f "$r"/*.go "$r"/*.s
        cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go /usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$r"/
        mv "$dl/tree" "$SRC" && rm -rf "$dl"
    fi
}

# `providerless` leaves out the in-tree cloud providers (AWS, Azure, GCE, OpenStack, vSphere)
# and their volume plugins, which a one-node test cluster never uses: their SDKs are the
# larger part of a cold build.
build() {
    need_root
    [ -d "$SRC" ] || install
    local want="kube-apiserver kube-controller-manager kube-scheduler kubelet"
    log "building $want (Go build cache in $SRC/_output)"
    ( cd "$SRC" \
        && export PATH=/usr/lib/go/bin:$PATH HOME=$CACHE/home CGO_ENABLED=0 \
                  GOFLAGS="-p=2 -tags=providerless" \
                  GOPATH=$SRC/.go KUBE_GIT_VERSION=v$KVER KUBE_GIT_TREE_STATE=clean \
                  KUBE_GIT_COMMIT=debian-$KVER \
        && mkdir -p "$HOME" .go/src/k8s.io \
        && { [ -L .go/src/k8s.io/kubernetes ] || ln -s ../../.. .go/src/k8s.io/kubernetes; } \
        && nice -n 10 make -s WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet" >/dev/null )
    mkdir -p "$KBIN"
    for b in $want; do command install -m 0755 "$SRC/_output/bin/$b" "$KBIN/$b"; done
}

# ------------------------------------------------------------------------------------------
BUILDAH_ROOT=$CACHE/buildah
buildah_() { buildah --root "$BUILDAH_ROOT/root" --runroot "$BUILDAH_ROOT/run" --storage-driver vfs "$@"; }

image() {
    need_root
    [ -d "$SRC" ] || install
    # The machine's CA bundle goes into the base (pip inside the build reaches PyPI through
    # whatever TLS-inspecting egress the machine trusts); its digest names the base, so a
    # changed bundle makes a new one.
    local cabundle=/etc/ssl/certs/ca-certificates.crt
    local img=$CACHE/img base
    base=localhost/receipts-k8s-base:bookworm-$(sha256sum "$cabundle" | cut -c1-12)
    mkdir -p "$img"
    # The pod sandbox ("pause") image, from the Kubernetes source: a static C program.
    if [ ! -f "$img/pause.tar" ]; then
        local p=$img/pause-ctx
        rm -rf "$p" && mkdir -p "$p"
        gcc -Os -static -o "$p/pause" "$SRC/build/pause/linux/pause.c" && strip "$p/pause"
        printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' > "$p/Containerfile"
        buildah_ bud --isolation chroot -q -t "$PAUSE_IMAGE" "$p" >/dev/null
        buildah_ push -q "$PAUSE_IMAGE" "oci-archive:$img/pause.tar.tmp:$PAUSE_IMAGE"
        mv "$img/pause.tar.tmp" "$img/pause.tar" && rm -rf "$p"
    fi
    # The Python base: Debian bookworm (python3 3.11) made by debootstrap, kept in buildah's
    # storage between runs. Debian marks its Python "externally managed" (PEP 668); the
    # official python image's is not, so the marker is removed to let the Dockerfile's
    # `pip install` behave as it does there.
    if ! buildah_ inspect --type image "$base" >/dev/null 2>&1; then
        log "making the base image with debootstrap"
        local rootfs=$img/rootfs mirror
        mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
        rm -rf "$rootfs"
        debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,passwd \
            bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >"$img/debootstrap.log" 2>&1 \
            || { tail -20 "$img/debootstrap.log" >&2; return 1; }
        rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
        mkdir -p "$rootfs/etc/ssl/certs" && cp "$cabundle" "$rootfs/etc/ssl/certs/ca-certificates.crt"
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        local ctr mnt
        ctr=$(buildah_ from scratch)
        mnt=$(buildah_ mount "$ctr")
        cp -a "$rootfs/." "$mnt/"
        buildah_ umount "$ctr" >/dev/null
        buildah_ config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            --env LANG=C.UTF-8 --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
            --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --cmd python3 "$ctr"
        buildah_ commit -q "$ctr" "$base" >/dev/null
        buildah_ rm "$ctr" >/dev/null
        rm -rf "$rootfs"
        # an older base (another CA bundle) is of no further use
        for old in $(buildah_ images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/receipts-k8s-base:' | grep -vx "$base"); do
            buildah_ rmi "$old" >/dev/null 2>&1 || true
        done
    fi
    # The image is rebuilt only when what the Dockerfile copies (or the base) changed.
    local digest
    digest=$( (cd "$REPO" && find Dockerfile requirements.lock pyproject.toml README.md migrations src \
                 -type f ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
                 | sort -z | xargs -0 sha256sum; echo "$base") | sha256sum | cut -c1-16)
    if [ -f "$img/receipts.tar" ] && [ "$(cat "$img/receipts.digest" 2>/dev/null)" = "$digest" ]; then
        log "the image is current ($digest)"
        return 0
    fi
    log "building the project's image from its Dockerfile (PYTHON_IMAGE=$base)"
    buildah_ bud --isolation chroot --layers=false -q --build-arg "PYTHON_IMAGE=$base" \
        -f "$REPO/Dockerfile" -t "$IMAGE" "$REPO" >"$img/build.log" 2>&1 \
        || { tail -30 "$img/build.log" >&2; return 1; }
    rm -f "$img/receipts.tar" "$img/receipts.digest"
    buildah_ push -q "$IMAGE" "oci-archive:$img/receipts.tar:$IMAGE"
    echo "$digest" > "$img/receipts.digest"
    # keep the base, drop the rest (vfs stores every layer as a full copy)
    buildah_ rmi "$IMAGE" >/dev/null 2>&1 || true
    buildah_ rmi --prune >/dev/null 2>&1 || true
}

# ------------------------------------------------------------------------------------------
start_bg() {   # start_bg NAME CMD...: a background process, its PID in $RUN/NAME.pid
    local name=$1; shift
    setsid "$@" >"$LOGS/$name.log" 2>&1 < /dev/null &
    echo $! > "$RUN/$name.pid"
}
wait_for() {   # wait_for SECONDS CMD...: until CMD succeeds
    local limit=$1; shift
    local end=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $end ] || { log "timed out after ${limit}s waiting for: $*"; return 1; }
        sleep 0.5
    done
}
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

certs() {
    mkdir -p "$PKI"
    ( cd "$PKI"
      openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj "/CN=receipts-k8s-ca" 2>/dev/null
      openssl genrsa -out sa.key 2048 2>/dev/null
      openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
      leaf() {   # leaf NAME SUBJECT [SUBJECT_ALT_NAMES]
          openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
          if [ -n "${3:-}" ]; then
              printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$3"
          else
              printf 'extendedKeyUsage=clientAuth\n'
          fi > "$1.ext"
          openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" \
              -days 2 -extfile "$1.ext" 2>/dev/null
      }
      leaf apiserver "/CN=kube-apiserver" "IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc"
      leaf admin "/O=system:masters/CN=admin"
      leaf kubelet "/O=system:nodes/CN=system:node:node1" "IP:127.0.0.1,IP:$NODE_IP,DNS:localhost,DNS:node1"
      leaf apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
      leaf front-proxy-client "/CN=front-proxy-client"
      leaf extmetrics "/CN=external-metrics" "IP:$NODE_IP"
      for u in admin kubelet; do
          local k="$TOOLS/kubectl --kubeconfig=$PKI/$u.kubeconfig"
          $k config set-cluster c --server="https://127.0.0.1:$API_PORT" --certificate-authority=ca.crt --embed-certs >/dev/null
          $k config set-credentials u --client-certificate="$u.crt" --client-key="$u.key" --embed-certs >/dev/null
          $k config set-context c --cluster=c --user=u >/dev/null
          $k config use-context c >/dev/null
      done )
}

up() {
    need_root
    [ -x "$KBIN/kubelet" ] || { log "not built: run '$0 build' first"; return 1; }
    [ -f "$CACHE/img/receipts.tar" ] || { log "no image: run '$0 image' first"; return 1; }
    if [ -d "$RUN" ] && ls "$RUN"/*.pid >/dev/null 2>&1; then
        log "a previous cluster was not taken down: taking it down first"; down
    fi
    for port in $API_PORT $ETCD_PORT $ETCD_PEER $KUBELET_PORT 30248 40257 40259; do
        port_free "$port" || { log "port $port is in use"; return 1; }
    done
    ! ip link show "$BRIDGE" >/dev/null 2>&1 || { log "bridge $BRIDGE exists: run '$0 down'"; return 1; }
    rm -rf "$STATE"
    mkdir -p "$RUN" "$LOGS" "$STATE/cni" "$STATE/ctrd" "$STATE/kubelet"
    certs
    local kubectl="$TOOLS/kubectl --kubeconfig=$PKI/admin.kubeconfig"

    start_bg etcd etcd --name node1 --data-dir "$STATE/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER" \
        --initial-cluster "node1=http://127.0.0.1:$ETCD_PEER"

    cat > "$STATE/cni/10-bridge.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "receipts-k8s", "plugins": [{"type": "bridge", "bridge": "$BRIDGE",
 "isGateway": true, "ipMasq": false, "hairpinMode": true, "ipam": {"type": "host-local",
 "dataDir": "$STATE/cni/ipam", "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP",
 "rangeStart": "$NET_BASE.10", "rangeEnd": "$NET_BASE.200"}]]}}]}
EOF
    cat > "$STATE/ctrd/config.toml" <<EOF
version = 2
root = "$STATE/ctrd/root"
state = "$STATE/ctrd/state"
[grpc]
  address = "$STATE/ctrd/containerd.sock"
[ttrpc]
  address = "$STATE/ctrd/containerd.sock.ttrpc"
[debug]
  address = "$STATE/ctrd/debug.sock"
[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  sandbox_image = "$PAUSE_IMAGE"
  # This machine kind's sandbox lacks CAP_SYS_RESOURCE, so runc cannot give a pod sandbox
  # its negative oom_score_adj ("failed to update /proc/self/oom_score_adj: Permission denied").
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni"
EOF
    start_bg containerd containerd --config "$STATE/ctrd/config.toml"
    local ctr="ctr --address $STATE/ctrd/containerd.sock -n k8s.io"
    wait_for 60 $ctr version
    $ctr images import "$CACHE/img/pause.tar" >/dev/null
    $ctr images import "$CACHE/img/receipts.tar" >/dev/null

    # The bridge exists before the kubelet starts, so that NODE_IP is a local address: the
    # kubelet refuses a loopback node IP, and `kubectl logs` needs the node's address.
    ip link add "$BRIDGE" type bridge
    ip addr add "$NODE_IP/$PREFIX_LEN" dev "$BRIDGE"
    ip link set "$BRIDGE" up

    wait_for 60 etcdctl --endpoints "http://127.0.0.1:$ETCD_PORT" endpoint health
    start_bg apiserver "$KBIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
        --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" --insecure-port=0 \
        --endpoint-reconciler-type=none --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
        --client-ca-file="$PKI/ca.crt" --service-account-key-file="$PKI/sa.pub" \
        --service-account-signing-key-file="$PKI/sa.key" --service-account-issuer=https://kubernetes.default.svc \
        --service-cluster-ip-range=10.96.0.0/24 --authorization-mode=Node,RBAC \
        --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
        --kubelet-preferred-address-types=InternalIP --requestheader-client-ca-file="$PKI/ca.crt" \
        --requestheader-allowed-names=front-proxy-client --requestheader-username-headers=X-Remote-User \
        --requestheader-group-headers=X-Remote-Group --requestheader-extra-headers-prefix=X-Remote-Extra- \
        --proxy-client-cert-file="$PKI/front-proxy-client.crt" --proxy-client-key-file="$PKI/front-proxy-client.key" \
        --enable-aggregator-routing=true --profiling=false
    wait_for 120 $kubectl get --raw /readyz
    start_bg controller-manager "$KBIN/kube-controller-manager" --kubeconfig="$PKI/admin.kubeconfig" \
        --authentication-kubeconfig="$PKI/admin.kubeconfig" --authorization-kubeconfig="$PKI/admin.kubeconfig" \
        --bind-address=127.0.0.1 --secure-port=40257 --port=0 --leader-elect=false \
        --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
        --use-service-account-credentials=true --cluster-signing-cert-file="$PKI/ca.crt" \
        --cluster-signing-key-file="$PKI/ca.key" --horizontal-pod-autoscaler-sync-period=5s \
        --controllers='*,-nodeipam,-cloud-node-lifecycle,-service,-route'
    start_bg scheduler "$KBIN/kube-scheduler" --kubeconfig="$PKI/admin.kubeconfig" \
        --authentication-kubeconfig="$PKI/admin.kubeconfig" --authorization-kubeconfig="$PKI/admin.kubeconfig" \
        --bind-address=127.0.0.1 --secure-port=40259 --port=0 --leader-elect=false
    cat > "$STATE/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 30248
authentication: {anonymous: {enabled: false}, webhook: {enabled: true}, x509: {clientCAFile: $PKI/ca.crt}}
authorization: {mode: Webhook}
tlsCertFile: $PKI/kubelet.crt
tlsPrivateKeyFile: $PKI/kubelet.key
cgroupDriver: cgroupfs
failSwapOn: false
evictionHard: {memory.available: "100Mi", nodefs.available: "2%", imagefs.available: "2%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: ""
EOF
    # kubelet 1.20 writes container logs under /var/log/pods and /var/log/containers (fixed
    # paths); `down` removes what the test namespace left there.
    start_bg kubelet "$KBIN/kubelet" --config="$STATE/kubelet/config.yaml" --kubeconfig="$PKI/kubelet.kubeconfig" \
        --container-runtime=remote --container-runtime-endpoint="unix://$STATE/ctrd/containerd.sock" \
        --root-dir="$STATE/kubelet/root" --hostname-override=node1 --node-ip="$NODE_IP" \
        --pod-infra-container-image="$PAUSE_IMAGE" --oom-score-adj=0 --v=1
    wait_for 120 sh -c "$kubectl get node node1 --no-headers | grep -qw Ready"
    log "cluster up: KUBECONFIG=$PKI/admin.kubeconfig"
}

pid_alive() { [ -f "$RUN/$1.pid" ] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }
stop_pid() {   # stop_pid NAME: SIGTERM, up to 15 s, then SIGKILL
    [ -f "$RUN/$1.pid" ] || return 0
    local pid; pid=$(cat "$RUN/$1.pid")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        local end=$((SECONDS + 15))
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 0.2; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$RUN/$1.pid"
}

down() {
    need_root
    # the test's own helpers first (the external-metrics stand-in, and anything else the
    # suite registered in $RUN), then the node, the control plane, the runtime, etcd
    local n
    for f in "$RUN"/test-*.pid; do [ -e "$f" ] && { n=$(basename "$f" .pid); stop_pid "$n"; }; done
    for n in kubelet scheduler controller-manager apiserver; do stop_pid "$n"; done
    local sock=$STATE/ctrd/containerd.sock netns=""
    if pid_alive containerd && [ -S "$sock" ]; then
        local ctr="ctr --address $sock -n k8s.io"
        # pod network namespaces (CNI names them /run/netns/cni-<uuid>), from the sandboxes
        netns=$(for c in $($ctr containers ls -q 2>/dev/null); do $ctr containers info "$c" 2>/dev/null; done \
                | grep -o '"/var/run/netns/cni-[^"]*"\|"/run/netns/cni-[^"]*"' | tr -d '"' | sort -u || true)
        for t in $($ctr tasks ls -q 2>/dev/null); do $ctr tasks kill -s SIGKILL "$t" >/dev/null 2>&1 || true; done
        for c in $($ctr containers ls -q 2>/dev/null); do
            $ctr tasks rm -f "$c" >/dev/null 2>&1 || true
            $ctr containers rm "$c" >/dev/null 2>&1 || true
        done
    fi
    # containerd-shim processes run in their own session; they hold the pods' mounts
    if [ -d "$STATE/ctrd" ]; then
        for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $STATE/ctrd/containerd.sock" 2>/dev/null || true); do
            kill -9 "$p" 2>/dev/null || true
        done
    fi
    stop_pid containerd
    stop_pid etcd
    # mounts under the state folder (kubelet volumes, containerd rootfs and shm), deepest first
    if [ -d "$STATE" ]; then
        grep -o " $STATE/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    fi
    # `umount -c` works on these nsfs mounts where plain umount and `ip netns delete` fail
    for n in $netns; do umount -c "$n" 2>/dev/null || umount -l "$n" 2>/dev/null || true; rm -f "$n"; done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf /var/log/pods/receipts-k8s_* /var/log/containers/*_receipts-k8s_* 2>/dev/null || true
    rm -rf "$STATE"
    log "cluster down"
}

env_() {   # the environment tests/k8s reads
    cat <<EOF
export KUBECONFIG=$PKI/admin.kubeconfig
export RECEIPTS_K8S_STATE=$STATE
export RECEIPTS_K8S_NODE_IP=$NODE_IP
export RECEIPTS_K8S_IMAGE=$IMAGE
export RECEIPTS_K8S_CERT=$PKI/extmetrics.crt
export RECEIPTS_K8S_KEY=$PKI/extmetrics.key
EOF
}

# `make test-k8s`: everything, then down (also on failure or interrupt).
test_() {
    need_root
    local t0=$SECONDS
    install
    build
    log "build ready after $((SECONDS - t0)) s"
    image
    log "image ready after $((SECONDS - t0)) s"
    trap 'down' EXIT
    trap 'exit 130' INT TERM
    up
    log "cluster up after $((SECONDS - t0)) s"
    local rc=0
    ( eval "$(env_)"
      export PATH="$TOOLS:$REPO/.venv/bin:$PATH"
      cd "$REPO" && "$REPO/.venv/bin/pytest" -q -p no:cacheprovider tests/k8s ${PYTEST_ARGS:-} ) || rc=$?
    if [ $rc -ne 0 ]; then
        log "tests failed; the last lines of each component's log:"
        for f in "$LOGS"/*.log; do echo "== $f"; tail -n 15 "$f"; done >&2
    fi
    log "done after $((SECONDS - t0)) s (rc=$rc)"
    return $rc
}

case "${1:-}" in
    install|build|image|up|down) "$1" ;;
    env) env_ ;;
    test) test_ ;;
    *) echo "usage: $0 install|build|image|up|down|env|test" >&2; exit 2 ;;
esac
