"""What shapes a reply beyond sampling: grammars, tools, chat templates.

    response_format.py response_format / structured_outputs / guided_* -> one checked spec
    tools.py           tools, tool_choice -> the template, grammar and parser to use
    tool_parsers.py    tool calls out of the reply text, streamed (hermes, llama3_json, ...)
    json_scan.py       an incremental JSON object scanner for the tool-call parsers
    chat_template.py   rendering a chat template (Jinja, as transformers does)
    templates/         shipped chat templates (smollm2_tools.jinja: SmolLM2 with tools)
"""
