"""The tiny test models' chat template: the Qwen3.5/3.6 family's conventions, in regen's own Jinja.

The users' target renders with the template its checkpoints publish; the tests must meet the same conventions,
or the shapes that break on the real target never break in a test. Written from the family's behaviour (its text
is not copied): tools in the system turn, XML tool calls read from `arguments|items`, reasoning only after the
last user query unless `preserve_thinking`, grouped tool responses, trimmed contents, content parts, the
family's refusals, and the thinking generation prompt. The list, convention by convention:
docs/formats.md#the-test-models-chat-template.
"""

from __future__ import annotations

FAMILY_CHAT_TEMPLATE = r"""{#- regen's tiny models: the Qwen3.5/3.6 family's conventions (workers/tiny_chat_template.py). -#}
{%- set seen = namespace(images=0, videos=0) %}
{%- macro render_parts(content, count_vision, in_system=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is none or content is undefined %}
    {%- elif content is iterable and content is not mapping %}
        {%- for part in content %}
            {%- if 'image' in part or 'image_url' in part or part.type == 'image' %}
                {%- if in_system %}{{- raise_exception('A system turn cannot hold an image.') }}{%- endif %}
                {%- if count_vision %}{%- set seen.images = seen.images + 1 %}{%- endif %}
                {%- if add_vision_id %}{{- 'Picture ' ~ seen.images ~ ': ' }}{%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in part or part.type == 'video' %}
                {%- if in_system %}{{- raise_exception('A system turn cannot hold a video.') }}{%- endif %}
                {%- if count_vision %}{%- set seen.videos = seen.videos + 1 %}{%- endif %}
                {%- if add_vision_id %}{{- 'Video ' ~ seen.videos ~ ': ' }}{%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in part %}
                {{- part.text }}
            {%- else %}
                {{- raise_exception('Unknown content part: expected text, image or video.') }}
            {%- endif %}
        {%- endfor %}
    {%- else %}
        {{- raise_exception('Unknown content type: expected a string or a list of parts.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- set system_text = '' %}
{%- if messages[0].role == 'system' %}
    {%- set system_text = render_parts(messages[0].content, false, true)|trim %}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n# Tools\n\nThese functions are available to you:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' ~ (tool|tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, reply with exactly this shape and nothing after it:\n\n<tool_call>\n'
        '<function=function_name>\n<parameter=parameter_name>\nvalue, on as many lines as it needs\n</parameter>\n'
        '</function>\n</tool_call>\n\nRules:\n- Each <function=...></function> block sits inside its own '
        '<tool_call></tool_call> tags.\n- Give every required parameter.\n- Reasoning about a call goes before it, '
        'never after.\n- When no function fits, answer normally and do not mention functions.' }}
    {%- if system_text %}
        {{- '\n\n' ~ system_text }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' ~ system_text ~ '<|im_end|>\n' }}
{%- endif %}
{%- set query = namespace(open=true, last=messages|length - 1) %}
{%- for message in messages|reverse %}
    {%- if query.open and message.role == 'user' %}
        {%- set said = render_parts(message.content, false)|trim %}
        {%- if not (said.startswith('<tool_response>') and said.endswith('</tool_response>')) %}
            {%- set query.open = false %}
            {%- set query.last = messages|length - loop.index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if query.open %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set text = render_parts(message.content, true)|trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' ~ text ~ '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in text %}
            {%- set reasoning = text.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set text = text.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if (preserve_thinking is defined and preserve_thinking is true) or loop.index0 > query.last %}
            {{- '<think>\n' ~ (reasoning|trim) ~ '\n</think>\n\n' }}
        {%- endif %}
        {{- text }}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for call in message.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- if not loop.first %}
                    {{- '\n' }}
                {%- elif text|trim %}
                    {{- '\n\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' ~ fn.name ~ '>\n' }}
                {%- if fn.arguments is defined %}
                    {%- for key, value in fn.arguments|items %}
                        {{- '<parameter=' ~ key ~ '>\n' }}
                        {{- value if value is string else value|tojson }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.previtem and loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ text ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""
