import { createContext, useContext } from "react";
import { translate, type Language, type StringKey } from "./strings";

export type Translate = (key: StringKey, values?: Record<string, string | number>) => string;

export const LanguageContext = createContext<Language>("en");

export function useT(): Translate {
  const language = useContext(LanguageContext);
  return (key, values) => translate(language, key, values);
}
