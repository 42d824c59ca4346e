"""The connection layer under the HTTP app: connection limits, timeouts, open-file limits."""
