"""The errors of chat templates (chat_template.py, chat_sandbox.py), apart from both so that
neither imports the other to raise them."""


class ChatTemplateError(ValueError):
    """A template that cannot be rendered; the message says why, for a person."""


class ChatTemplateSecurityError(ChatTemplateError):
    """A template that tried to escape the sandbox or exhaust resources."""
