"""The launcher: `serve` (gateway + supervised worker children), `--gateways N` scale-out, child-process helpers,
health probes, and their settings (`config`). Imports nothing here, so `hybridgate.run.config` loads alone."""
