"""OpenAI-compatible HTTP gateway over the stdio engine subprocess (`colibri gateway`)."""
