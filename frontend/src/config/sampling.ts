/** The sampling fields a person can edit, with the ranges the form enforces. */

import type { Sampling } from "../api/streams";

export interface SamplingField {
  key: keyof Sampling;
  min: number;
  max: number;
  step: number;
  integer: boolean;
}

export const SAMPLING_FIELDS: readonly SamplingField[] = [
  { key: "max_tokens", min: 1, max: 100000, step: 1, integer: true },
  { key: "temperature", min: 0, max: 5, step: 0.1, integer: false },
  { key: "top_p", min: 0, max: 1, step: 0.05, integer: false },
  { key: "top_k", min: 0, max: 65536, step: 1, integer: true },
  { key: "presence_penalty", min: -5, max: 5, step: 0.1, integer: false },
  { key: "frequency_penalty", min: -5, max: 5, step: 0.1, integer: false },
  { key: "penalty_decay", min: 0, max: 1, step: 0.001, integer: false },
];

/** A typed value if it is a number of the right kind within range, else null. */
export function parseSamplingValue(field: SamplingField, text: string): number | null {
  if (text.trim() === "") return null;
  const value = Number(text);
  if (!Number.isFinite(value) || value < field.min || value > field.max) return null;
  if (field.integer && !Number.isInteger(value)) return null;
  return value;
}
