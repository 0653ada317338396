from setuptools import find_packages, setup

setup(
    name="hivemind-accum",
    version="0.1.0",
    description="hivemind gradient accumulation as cheap as native PyTorch accumulation",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hivemind_accum", "hivemind_accum.*"]),
    # the pull requests for hivemind: each a description and its commits as patches (hivemind_accum/upstream)
    package_data={"hivemind_accum.upstream": ["pull_requests/ruff.toml", "pull_requests/*/*.md", "pull_requests/*/*.patch"]},
    python_requires=">=3.9",
    # hivemind 1.1.12 only; torch from the oldest release CI tests, with no upper bound, so that pip never downgrades
    # a newer torch: each private torch interface is checked at its first use instead (docs/compatibility.md)
    install_requires=["hivemind==1.1.12", "torch>=2.3.1"],
)
