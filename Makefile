# vmcsnap: the two commands of the README, and their parts.
VMCSNAP := target/release/vmcsnap

.PHONY: demo demo-redis test test-faults test-nested lint deps build guest qemu10 clean-run fuzz

demo: guest
	scripts/demo.sh

demo-redis: guest
	scripts/demo-redis.sh

# The fault-injection feature (the hidden --inject-fault and the agent's
# faults, crates/agent/src/fault) is on for the tests only: the test files
# that inject faults require it (crates/vmcsnap/Cargo.toml), and a plain
# `cargo build --release` leaves every fault out.
TEST_FEATURES := --features vmcsnap/fault-injection

# Built with the tests' features before the guest assets, so that the
# test run reuses the build instead of compiling the agent a second time.
test: lint qemu10
	cargo build --release --workspace --bins $(TEST_FEATURES)
	$(VMCSNAP) guest build
	cargo test --release --workspace $(TEST_FEATURES) --no-fail-fast 2>&1

# Guard rails: a clippy warning, an unformatted file or an unsafe block
# without a SAFETY comment (workspace lints in Cargo.toml) fails the tests,
# and so does an import circle of more than 2 files or an import from the
# VM layer up (scripts/import_graph.py, docs/architecture.md "Layers").
# Clippy runs twice: on the workspace with the faults (what the tests
# build), and on the crates the feature changes without them (what a
# release build is).
lint: deps
	cargo fmt --all --check
	python3 scripts/import_graph.py --max-circle 2
	cargo clippy --release --workspace --all-targets $(TEST_FEATURES) -- -D warnings
	cargo clippy --release -p vmcsnap-agent -p vmcsnap --all-targets -- -D warnings

deps:
	scripts/install-deps.sh

build: deps
	cargo build --release --workspace --bins

guest: build
	$(VMCSNAP) guest build

# QEMU 10.0 beside the system's 7.2 (Debian's package, unpacked under the
# cache; the system's QEMU is not touched): the tests run the end-to-end core
# on both versions. docs/qemu-versions.md.
qemu10:
	scripts/install-qemu.sh 10.0

# Every cargo-fuzz target of every crate (crates/*/fuzz), FUZZ_SECONDS each
# (default 600), two at a time at nice 19; prints target, seconds,
# executions, crashes and saves them in target/fuzz-report/fuzz.json.
# Needs the nightly toolchain; installs cargo-fuzz if missing.
fuzz:
	scripts/fuzz.sh

# The fault matrix (issue 20): every operation × fault cell of
# tests/fault_matrix.rs (the default suite runs its fast cells), the agent
# kill -9 rounds of agent_killed.rs and the capture faults of
# snapshot_failure.rs. Runs as root (it mounts a tmpfs to fill a disk).
test-faults: guest
	VMCSNAP_FAULTS_ALL=1 cargo test --release -p vmcsnap $(TEST_FEATURES) --test fault_matrix --test agent_killed --test snapshot_failure -- --include-ignored --nocapture 2>&1

# The DAMON access-data test (issue 23) in a nested VM with a 6.12 kernel:
# opt-in, slow (tens of minutes under TCG), not part of `make test`. Builds
# and caches the nested VM image once (root). See docs/access-data.md.
test-nested: build
	scripts/test-nested.sh
