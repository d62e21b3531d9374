"""The host side of each capability the guest may be granted.

``hostcall`` carries host functions (and the framing every host call shares), ``http`` is
mediated HTTP. The contract each implements is its WIT interface in ``guest/wit/``; each
module's docstring names the threat it mediates.
"""
