"""Placeholder until the example project lands (issue 7)."""

print("task-locks demo: coming soon (see README.md)")
