"""The transport fault matrix of the conformance suite."""
