"""JSON schemas for the structured-output tests: nested objects, arrays, enums, anyOf,
bounded numbers, string formats. Strings and arrays carry bounds where an unbounded one
would let a 135M model ramble until max_tokens (the grammar allows it; the test would
then only measure the model's taste for long names)."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT_LIST = {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}

SCHEMAS: dict[str, dict] = {
    "integer": {"type": "integer", "minimum": -100000, "maximum": 100000},
    "bounded_integer": {"type": "integer", "minimum": 3, "maximum": 9},
    "number_bounds": {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}},
                      "required": ["price"], "additionalProperties": False},
    "boolean": {"type": "boolean"},
    "enum_string": {"type": "string", "enum": ["red", "green", "blue"]},
    "const": {"type": "object", "properties": {"kind": {"const": "point"}}, "required": ["kind"]},
    "flat_person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 130}},
                    "required": ["name", "age"], "additionalProperties": False},
    "nested_address": {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string",
                                                                                           "pattern": "^[0-9]{5}$"}},
                                  "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_of_ints": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                      "minItems": 2, "maxItems": 5},
    "array_of_strings": SHORT_LIST,
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "label": NAME},
        "required": ["id", "label"], "additionalProperties": False}},
    "enum_in_object": {"type": "object", "properties": {
        "status": {"enum": ["open", "closed", "pending"]}, "priority": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["status", "priority"], "additionalProperties": False},
    "anyof_scalar": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "boolean"}]},
    "anyof_objects": {"anyOf": [
        {"type": "object", "properties": {"circle": {"type": "number", "minimum": 0, "maximum": 100}},
         "required": ["circle"], "additionalProperties": False},
        {"type": "object", "properties": {"square": {"type": "number", "minimum": 0, "maximum": 100}},
         "required": ["square"], "additionalProperties": False}]},
    "nullable": {"type": "object", "properties": {"nickname": {"anyOf": [NAME, {"type": "null"}]}},
                 "required": ["nickname"], "additionalProperties": False},
    "date_format": {"type": "object", "properties": {"born": {"type": "string", "format": "date"}},
                    "required": ["born"], "additionalProperties": False},
    "email_format": {"type": "object", "properties": {"email": {"type": "string", "format": "email"}},
                     "required": ["email"], "additionalProperties": False},
    "uuid_format": {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
                    "required": ["id"], "additionalProperties": False},
    "ipv4_format": {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
                    "required": ["ip"], "additionalProperties": False},
    "datetime_format": {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}},
                        "required": ["at"], "additionalProperties": False},
    "string_pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                       "required": ["code"], "additionalProperties": False},
    "string_lengths": {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 6}},
                       "required": ["word"], "additionalProperties": False},
    "deep_nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
    "optional_fields": {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900,
                                                                                  "maximum": 2100}},
                        "required": ["title"], "additionalProperties": False},
    "ref_defs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "tuple_items": {"type": "array", "prefixItems": [NAME, {"type": "integer", "minimum": 0, "maximum": 99}],
                    "items": False, "minItems": 2},
    "exclusive_bounds": {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0,
                                                                     "exclusiveMaximum": 1}},
                         "required": ["ratio"], "additionalProperties": False},
    "weather_tool_args": {"type": "object", "properties": {
        "city": NAME, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "customer": {"type": "object", "properties": {"name": NAME, "vip": {"type": "boolean"}},
                     "required": ["name", "vip"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 20}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "paid": {"type": "boolean"}},
        "required": ["customer", "items", "paid"], "additionalProperties": False},
    "mixed_array": {"type": "array", "minItems": 1, "maxItems": 4,
                    "items": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}},
    "null": {"type": "null"},
    "unique_enum_list": {"type": "object", "properties": {"days": {"type": "array", "maxItems": 3, "items": {
        "enum": ["mon", "tue", "wed", "thu", "fri"]}}}, "required": ["days"], "additionalProperties": False},
}
