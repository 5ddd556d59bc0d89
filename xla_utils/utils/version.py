"""The package's version, in a module of its own that imports nothing.

``xla_utils.__version__`` re-exports it; modules inside the package (the cache builder
records it in every manifest) import it from here, not from the package face.
"""
__version__ = "0.1.0"
