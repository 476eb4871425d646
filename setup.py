"""anyrec: DLRM-style recommendation training on any accelerator."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
common = [
    line.strip() for line in (here / "requirements" / "common.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

setup(
    name="anyrec",
    version="0.1.0",
    description="Train DLRM-style recommendation models on NVIDIA, AMD and CPU from one code base",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # enum.StrEnum
    packages=find_packages(include=["anyrec", "anyrec.*"]) + ["anyrec.configs"],
    # The Hydra config groups live at the repository root and ship inside the package.
    package_dir={"anyrec.configs": "configs"},
    package_data={"anyrec.configs": ["*.yaml", "*/*.yaml", "hydra/*/*.yaml"]},
    # torch, fbgemm-gpu(-cpu) and torchrec are hardware-specific: scripts/dev.sh installs the pair
    # for the machine (torchrec without its declared CUDA fbgemm-gpu dependency); see README.md.
    install_requires=common,
    extras_require={"dev": ["pytest>=8", "pytest-xdist>=3", "ruff>=0.6"]},  # README's fast tier: -n auto
    entry_points={
        "console_scripts": [
            "anyrec-train=anyrec.train:cli",
            "anyrec-plan=anyrec.plan:cli",
            "anyrec-calibrate=anyrec.calibrate:cli",
            "anyrec-parity=anyrec.parity:cli",
            "anyrec-export=anyrec.export:cli",
            "anyrec-predict=anyrec.predict:cli",
        ],
        "anyrec.backends": [
            "cpu=anyrec.backends.cpu:CPUBackend",
            "cuda=anyrec.backends.cuda:CUDABackend",
            "rocm=anyrec.backends.rocm:ROCmBackend",
        ],
    },
)
