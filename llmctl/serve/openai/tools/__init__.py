"""Function tools: what a chat request asks for, and tool calls parsed out of generated text."""
