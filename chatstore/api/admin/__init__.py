"""Operators' endpoints: /admin/*, /metrics and its history, the chat page and dashboard."""
