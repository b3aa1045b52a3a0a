# The lockmesh Wasm module for the lock-tier Deployment's init container
# (deploy/base/lock-tier/deployment.yaml): the module and its sha256 on busybox,
# which has the sh, sha256sum and cp the init container runs. Build from the
# repository root:
#   cargo build -p lockmesh-wasm-filter --target wasm32-wasip1 --release
#   docker build -f deploy/images/lock-tier-wasm.Dockerfile -t ghcr.io/lockmesh/lock-tier-wasm:0.1.0 .
# and pin the pushed image by digest in your overlay (kustomize `images:`).
FROM busybox:1.37-musl
COPY target/wasm32-wasip1/release/lockmesh_wasm_filter.wasm /lockmesh/lockmesh_wasm_filter.wasm
RUN cd /lockmesh && sha256sum lockmesh_wasm_filter.wasm > lockmesh_wasm_filter.wasm.sha256
USER 65532:65532
