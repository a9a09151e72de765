"""Core behaviour: Lock / AsyncLock over real Redis servers."""
