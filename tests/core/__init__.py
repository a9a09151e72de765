"""Core behaviour: Lock / AsyncLock over real Redis servers (issue 2's acceptance)."""
