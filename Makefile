# vmcsnap: the two commands of the README, and their parts.
VMCSNAP := target/release/vmcsnap

.PHONY: demo demo-redis test deps build guest clean-run

demo: guest
	scripts/demo.sh

demo-redis: guest
	scripts/demo-redis.sh

test: guest
	cargo test --release --workspace 2>&1

deps:
	scripts/install-deps.sh

build: deps
	cargo build --release --workspace --bins

guest: build
	$(VMCSNAP) guest build
