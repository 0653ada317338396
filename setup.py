from setuptools import find_packages, setup

setup(
    name="hivemind-accum",
    version="0.1.0",
    description="hivemind gradient accumulation as cheap as native PyTorch accumulation",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hivemind_accum", "hivemind_accum.*"]),
    python_requires=">=3.9",
    # hivemind 1.1.12 only; torch from the oldest to the newest release CI tests (docs/compatibility.md; the range is
    # hivemind_accum.optim.torch_internals.TESTED_TORCH, checked by tests/test_torch_internals.py)
    install_requires=["hivemind==1.1.12", "torch>=2.3.1,<=2.14.1"],
)
