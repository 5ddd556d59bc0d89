"""xla_utils.utils: small helpers every room uses: atomic writes, sizes, progress bars, did-you-mean

Importing this package runs nothing else; import the module you need. The names
users import are exported by :mod:`xla_utils` itself.

* ``version``: The package's version, in a module of its own that imports nothing
* ``atomic``: One atomic write
* ``units``: One byte formatter
* ``suggest``: Suggestions for typos
* ``progress``: Progress bars, in one place for the whole package, readable in a terminal
  and in a log
"""
