"""The transport fault matrix of the conformance suite (issue 12)."""
