"""The services built on the library: ``wasibox serve`` (HTTP) and ``wasibox mcp`` (MCP), and the
configuration file they share."""
