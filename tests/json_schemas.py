"""JSON schemas for the structured-output tests and benchmark, each with a prompt that
invites a matching answer: nested objects, arrays, enums, bounded numbers, required
fields, additionalProperties false, $defs and anyOf."""
from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 40}
_POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
          "required": ["x", "y"], "additionalProperties": False}

# (prompt, schema)
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a person.", {
        "type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                               "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("Give a city and its population.", {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"]}),
    ("Is the sky blue? Answer with a verdict.", {
        "type": "object", "properties": {"answer": {"type": "boolean"},
                                         "confidence": {"type": "number", "minimum": 0,
                                                        "maximum": 1}},
        "required": ["answer", "confidence"], "additionalProperties": False}),
    ("Pick a colour.", {
        "type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"], "additionalProperties": False}),
    ("List three fruits.", {
        "type": "object", "properties": {"fruits": {"type": "array", "items": _NAME,
                                                    "minItems": 1, "maxItems": 5}},
        "required": ["fruits"], "additionalProperties": False}),
    ("Rate a movie from 1 to 5.", {
        "type": "object", "properties": {"title": _NAME,
                                         "stars": {"type": "integer", "minimum": 1,
                                                   "maximum": 5}},
        "required": ["title", "stars"], "additionalProperties": False}),
    ("Give a point in the plane.", _POINT),
    ("Describe a line segment.", {
        "type": "object", "properties": {"start": _POINT, "end": _POINT},
        "required": ["start", "end"], "additionalProperties": False}),
    ("Describe a book.", {
        "type": "object", "properties": {
            "title": _NAME, "author": {"type": "object", "properties": {
                "first": _NAME, "last": _NAME}, "required": ["first", "last"],
                "additionalProperties": False},
            "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title", "author", "year"], "additionalProperties": False}),
    ("Give a temperature reading.", {
        "type": "object", "properties": {"celsius": {"type": "number", "minimum": -90,
                                                     "maximum": 60},
                                         "unit": {"const": "C"}},
        "required": ["celsius", "unit"], "additionalProperties": False}),
    ("List two people with their ages.", {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"name": _NAME,
                                             "age": {"type": "integer", "minimum": 0,
                                                     "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False}}),
    ("Describe the weather.", {
        "type": "object", "properties": {
            "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
            "wind_kmh": {"type": "number", "exclusiveMinimum": 0, "maximum": 200},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["condition", "humidity"], "additionalProperties": False}),
    ("Give a product with tags.", {
        "type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "tags": {"type": "array", "items": {"enum": ["new", "sale", "popular"]},
                     "maxItems": 3}},
        "required": ["sku", "price", "tags"], "additionalProperties": False}),
    ("Name a number.", {"type": "integer", "minimum": -50, "maximum": 50}),
    ("Say yes or no.", {"enum": ["yes", "no"]}),
    ("Give a short greeting.", {"type": "string", "maxLength": 30}),
    ("Describe an order.", {
        "$defs": {"item": {"type": "object", "properties": {
            "name": _NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["name", "qty"], "additionalProperties": False}},
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1},
                                         "items": {"type": "array",
                                                   "items": {"$ref": "#/$defs/item"},
                                                   "minItems": 1, "maxItems": 3}},
        "required": ["id", "items"], "additionalProperties": False}),
    ("Give an id, either a number or a code.", {
        "type": "object", "properties": {"id": {"anyOf": [
            {"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 8}]}},
        "required": ["id"], "additionalProperties": False}),
    ("Describe a user account.", {
        "type": "object", "properties": {
            "username": {"type": "string", "pattern": "^[a-z]{3,12}$"},
            "active": {"type": "boolean"},
            "roles": {"type": "array", "items": {"enum": ["admin", "editor", "viewer"]},
                      "minItems": 1, "maxItems": 3}},
        "required": ["username", "active", "roles"], "additionalProperties": False}),
    ("Give a matrix of small numbers.", {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2,
            "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("Describe a company and its address.", {
        "type": "object", "properties": {
            "name": _NAME, "employees": {"type": "integer", "minimum": 1, "maximum": 100000},
            "address": {"type": "object", "properties": {
                "street": _NAME, "city": _NAME, "zip": {"type": "string",
                                                        "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
            "public": {"type": "boolean"}},
        "required": ["name", "employees", "address"], "additionalProperties": False}),
    ("Give an event with a date.", {
        "type": "object", "properties": {
            "event": _NAME, "month": {"type": "integer", "minimum": 1, "maximum": 12},
            "day": {"type": "integer", "minimum": 1, "maximum": 31},
            "note": {"type": ["string", "null"], "maxLength": 40}},
        "required": ["event", "month", "day", "note"], "additionalProperties": False}),
]
