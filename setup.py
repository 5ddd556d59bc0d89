"""Packaging for xla_utils.

torch / torchvision / torch_xla are deliberately *not* install requirements:
Kaggle and Colab ship a matched pair, and pip resolving ``torch`` here would
replace it with an unmatched newer build. ``python -m xla_utils.env`` prints the
exact command for a machine that lacks them.
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

# fastprogress 1.1 made fastcore and python-fasthtml (a web stack: uvicorn, starlette, httpx,
# ...) requirements; 1.0.x requires nothing (1.0.0: numpy) and has every bar xla_utils uses.
# scripts/make_offline_wheels.py reads this list, so the offline wheels take the same pin.
INSTALL_REQUIRES = ["numpy", "pillow", "fastprogress>=1.0,<1.1", "cloudpickle"]

setup(
    name="xla_utils",
    version="0.1.0",
    description="Fast, painless PyTorch/XLA training on Kaggle and Colab TPUs: "
    "environment check, sharded uint8 image cache, one-cycle trainer, LR finder.",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["xla_utils", "xla_utils.*"]),
    package_data={"xla_utils": ["py.typed"]},  # PEP 561: the package ships its type hints
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "plot": ["matplotlib"],
        "tensorboard": ["tensorboard"],  # fit(tensorboard=...): xla_utils.train.board
        "demo": ["scikit-learn"],
        "gcs": ["fsspec", "gcsfs"],  # caches in gs:// buckets (xla_utils.cache.storage)
        "ray": ["ray"],  # build_cache(..., engine="ray")
        "test": [
            "pytest",
            "pytest-timeout",
            "scikit-learn",
            "scikit-image",
            "timm",  # test_ema, test_mixup (timm's EMA and Mixup), test_finetune (timm heads, no weights)
            "matplotlib",
            "tensorboard",  # test_board (reads the event files back)
            "nbclient",
            "nbformat",
            "ipykernel",
            # tests/test_install.py builds the wheel offline (no build isolation)
            "setuptools>=61",
            "wheel",
            "fsspec",
            "gcsfs",
            "gcp-storage-emulator",
            "ray",
        ],
    },
    entry_points={"console_scripts": ["tpu_cache_ds=xla_utils.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
