"""The lab: experiments, micro-benchmarks, GPU suites and dated notes. It imports the product; nothing in the
product imports it (the "product-no-lab" contract in pyproject.toml)."""
