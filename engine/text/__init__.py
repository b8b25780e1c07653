"""Text in and out: the tokenizer, chat templates and the streaming detokenizer."""
