"""Multimodal prompts as vLLM 0.33 builds them: media items, their identifiers, placeholder expansion.

``items`` (what each media part is and how the router learns it), ``hasher`` (vLLM's item hash),
``image_header`` (an image's size and conversion from its header), ``processors`` (placeholder expansion
per family), ``prompt`` (a rendered prompt's ids expanded, with each item's range).  See docs/multimodal.md.
"""
