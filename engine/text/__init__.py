"""Text handling shared by the ingress and `LLM.chat`, without torch: the tokenizer, chat
templates and incremental detokenization, tool-call formats (prompt, grammar, parsers) and
reasoning (`<think>`) parsers."""
