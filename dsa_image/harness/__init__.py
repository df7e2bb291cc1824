"""What the harnesses share: vLLM servers started, waited for, asked and stopped; models and prompts."""
