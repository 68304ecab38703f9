"""The `hp demo` job, its model and its orchestration."""
