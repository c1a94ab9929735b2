import { useEffect, useState } from "react";
import { Field, Input } from "@fluentui/react-components";
import type { Sampling } from "../api/streams";
import { parseSamplingValue, SAMPLING_FIELDS, type SamplingField } from "../config/sampling";
import { useT } from "../i18n/I18nContext";

/** Number inputs for sampling; a field reports a value to its owner only while it is valid. */
export function SamplingForm({
  value,
  onChange,
  testIdPrefix,
  columns = 1,
}: {
  value: Sampling;
  onChange: (next: Sampling) => void;
  testIdPrefix: string;
  columns?: number;
}) {
  return (
    <div style={{ display: "grid", gridTemplateColumns: `repeat(${columns}, minmax(0, 1fr))`, gap: "8px 12px" }}>
      {SAMPLING_FIELDS.map((field) => (
        <SamplingInput
          key={field.key}
          field={field}
          value={value[field.key]}
          onValue={(next) => onChange({ ...value, [field.key]: next })}
          testId={`${testIdPrefix}-${field.key}`}
        />
      ))}
    </div>
  );
}

function SamplingInput({
  field,
  value,
  onValue,
  testId,
}: {
  field: SamplingField;
  value: number;
  onValue: (next: number) => void;
  testId: string;
}) {
  const t = useT();
  const [text, setText] = useState(String(value));
  // Follow outside changes (another tab's save, a reset) unless the person is mid-edit on this value.
  useEffect(() => {
    setText((current) => (parseSamplingValue(field, current) === value ? current : String(value)));
  }, [field, value]);
  const valid = parseSamplingValue(field, text) !== null;
  return (
    <Field
      label={t(field.key)}
      size="small"
      validationState={valid ? "none" : "error"}
      validationMessage={valid ? undefined : t("samplingInvalid", { min: field.min, max: field.max })}
    >
      <Input
        size="small"
        type="number"
        inputMode="decimal"
        min={field.min}
        max={field.max}
        step={field.step}
        value={text}
        data-testid={testId}
        onChange={(_, data) => {
          setText(data.value);
          const parsed = parseSamplingValue(field, data.value);
          if (parsed !== null) onValue(parsed);
        }}
      />
    </Field>
  );
}
